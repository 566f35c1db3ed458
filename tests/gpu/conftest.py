"""The GPU suite (marker ``gpu``): real CUDA, real NVML, real worker processes.

Every test here is skipped, naming CUDA, where ``torch.cuda.is_available()`` is False (no
NVIDIA GPU or driver, or a CPU-only torch build), so CPU machines and CI stay green.
``tools/gpu-check.sh`` installs a CUDA torch on a bare GPU machine and runs ``-m gpu``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import urllib.request

import pytest
import torch

from tests.support.waiting import eventually

_HERE = pathlib.Path(__file__).resolve().parent

#: Why the suite skips on this machine ("" where CUDA is present).
NO_CUDA = "" if torch.cuda.is_available() else (
    f"needs CUDA: torch.cuda.is_available() is False (torch {torch.__version__}, "
    f"CUDA build {torch.version.cuda or 'none'}); run tools/gpu-check.sh on an NVIDIA GPU machine")


def pytest_collection_modifyitems(config, items):
    """Skip this directory's tests, naming CUDA, where there is none."""
    if not NO_CUDA:
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if _HERE in pathlib.Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@dataclasses.dataclass
class GpuCluster:
    """The embedded cluster on this machine's real GPUs (NVML inventory, no fake GPUs)."""

    http_port: int
    token: str
    gpus: int

    def placement(self) -> dict:
        """The scheduler's /v1/placement document."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}/v1/placement",
                                         headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())

    def workers_of(self, group: str) -> list[tuple[dict, dict]]:
        """(gpu entry, worker entry) of every worker of ``group`` in /v1/placement."""
        return [(gpu, w) for node in self.placement()["nodes"] for gpu in node["gpus"]
                for w in gpu["workers"] if w["group"] == group]

    def wait_memory(self, group: str, at_least: int = 0, at_most: int | None = None,
                    timeout: float = 30.0) -> list[tuple[dict, dict]]:
        """Poll /v1/placement until every worker of ``group`` shows between ``at_least`` and
        ``at_most`` bytes used (NVML readings travel with the agent's heartbeat, every 2 s).
        A rollout's sleep/wake test waits for ``at_most`` after sleep, ``at_least`` after wake."""
        def ready() -> list[tuple[dict, dict]]:
            entries = self.workers_of(group)
            ok = entries and all(at_least <= w["memory_used_bytes"] and (
                at_most is None or w["memory_used_bytes"] <= at_most) for _, w in entries)
            return entries if ok else []

        return eventually(ready, f"workers of {group!r} showing between {at_least} and {at_most} bytes used "
                                 f"in /v1/placement", timeout=timeout, interval=0.5)


@pytest.fixture(scope="module")
def gpu_cluster():
    """``podium.init()`` on this machine's GPUs (module scope; shut down after)."""
    import podium

    rt = podium.init()
    try:
        ports = json.loads((pathlib.Path(rt.log_dir) / "scheduler.port.json").read_text())
        state = rt.run(rt.cluster_state())
        gpus = sum(len(n.info.gpus) for n in state.nodes)
        if "CUDA_VISIBLE_DEVICES" not in os.environ:  # else torch sees a subset of NVML's GPUs
            assert gpus == torch.cuda.device_count(), (
                f"the node agent found {gpus} GPUs through NVML, torch sees {torch.cuda.device_count()}")
        yield GpuCluster(http_port=ports["http_port"], token=rt.token, gpus=gpus)
    finally:
        podium.shutdown()
