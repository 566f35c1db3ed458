"""The opt-in GPU memory cap on real processes without a GPU: the controller puts it in each
worker's environment, the worker host applies it before the user's constructor runs ("not
applied: no CUDA" here), reports it in its Describe stats, /v1/placement shows it beside the
worker's memory, and a CUDA out-of-memory error raised in a capped worker names the cap.
The allocation that actually fails against the cap is in tests/gpu/test_gpu_memory_cap.py."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
import torch

import podium
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.controller.session.runtime import get_runtime
from podium.errors import InvalidArgumentError, RemoteError, WorkerDiedError
from podium.worker import Dispatch, Worker, register
from tests.support.clusters import two_node_processes
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(240)


class CapProbe(Worker):
    """Records, in its constructor, what cap the host had already applied."""

    def __init__(self):
        super().__init__()
        from podium.worker.host import gpucap
        report = gpucap.current()
        self.at_construct = {"requested": report.requested, "detail": report.detail,
                             "fraction": report.fraction, "bytes": report.bytes,
                             "env": {k: v for k, v in os.environ.items() if k.startswith("PODIUM_GPU_MEMORY_CAP")}}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def seen(self):
        return self.at_construct

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def oom(self):
        # What torch raises when an allocation does not fit (here without a GPU to fill).
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


@pytest.fixture(scope="module")
def cap_cluster(tmp_path_factory):
    """A scheduler and 2 node agents (4 fake 80 GB GPUs each) as processes; the controller joined."""
    with two_node_processes(tmp_path_factory.mktemp("cap"), gpus_per_node=4) as procs:
        rt = podium.init(address=procs.address, token=procs.token)
        try:
            eventually(lambda: len(rt.run(rt.cluster_state()).nodes) == 2, "both node agents registering")
            yield procs
        finally:
            podium.shutdown()


def _placement(procs) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{procs.http_port}/v1/placement",
                                     headers={"Authorization": f"Bearer {procs.token}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def _workers_in_placement(doc: dict, group: str) -> list[tuple[dict, dict]]:
    return [(gpu, w) for node in doc["nodes"] for gpu in node["gpus"] for w in gpu["workers"]
            if w["group"] == group]


def test_fraction_cap_is_applied_before_the_constructor_and_shown_in_placement(cap_cluster):
    pool = ResourcePool([2], max_colocate_count=3, gpu_memory_cap="fraction")
    group = WorkerGroup(pool, ClassWithInitArgs(CapProbe))
    try:
        for seen in group.seen():
            assert seen["requested"] and seen["detail"] == "not applied: no CUDA"
            assert seen["fraction"] == pytest.approx(1 / 3)
            assert seen["env"] == {"PODIUM_GPU_MEMORY_CAP_FRACTION": repr(1 / 3)}
        rt = get_runtime()
        for handle in group.workers:
            stats = rt.run(handle.client.describe(timeout=10)).stats
            assert stats["gpu_memory_cap_requested"] == 1 and stats["gpu_memory_cap_applied"] == 0
            assert stats["gpu_memory_cap_fraction"] == pytest.approx(1 / 3)
        entries = _workers_in_placement(_placement(cap_cluster), group.name_prefix)
        assert len(entries) == 2
        for gpu, worker in entries:
            assert worker["gpu_fraction_text"] == "1/3" and "memory_used_bytes" in worker
            # Asked: a third of this (fake, 80 GB) GPU; reported by the worker: not applied.
            assert worker["memory_cap"] == {"fraction": pytest.approx(1 / 3), "text": "1/3",
                                            "bytes": gpu["memory_total_bytes"] // 3,
                                            "applied": False, "detail": "not applied: no CUDA"}
    finally:
        group.shutdown()


def test_group_byte_cap_overrides_the_pool_and_an_oom_names_it(cap_cluster):
    pool = ResourcePool([1], max_colocate_count=2, gpu_memory_cap="fraction")
    group = WorkerGroup(pool, ClassWithInitArgs(CapProbe), gpu_memory_cap="10GiB")
    try:
        [seen] = group.seen()
        assert seen["env"] == {"PODIUM_GPU_MEMORY_CAP_BYTES": str(10 << 30)} and seen["bytes"] == 10 << 30
        [(_, worker)] = _workers_in_placement(_placement(cap_cluster), group.name_prefix)
        assert worker["memory_cap"]["bytes"] == 10 << 30 and worker["memory_cap"]["text"] == "10.0 GiB"
        assert worker["memory_cap"]["applied"] is False
        with pytest.raises(RemoteError) as info:
            group.oom()
        message = str(info.value)
        assert "Podium GPU memory cap of 10.0 GiB per GPU" in message
        assert "not applied: no CUDA" in message and "Tried to allocate 2.00 GiB" in message
        assert info.value.remote_type == "torch.OutOfMemoryError"
    finally:
        group.shutdown()


def test_no_cap_by_default(cap_cluster):
    group = WorkerGroup(ResourcePool([1], max_colocate_count=2), ClassWithInitArgs(CapProbe))
    try:
        [seen] = group.seen()
        assert not seen["requested"] and seen["env"] == {}
        [(_, worker)] = _workers_in_placement(_placement(cap_cluster), group.name_prefix)
        assert worker["memory_cap"] is None
        stats = get_runtime().run(group.workers[0].client.describe(timeout=10)).stats
        assert "gpu_memory_cap_requested" not in stats
        with pytest.raises(RemoteError) as info:
            group.oom()
        assert "Podium" not in str(info.value)  # torch's own message, nothing added
    finally:
        group.shutdown()


def test_bad_caps_fail_before_any_worker_starts(cap_cluster):
    for bad in (0.0, 1.5, float("nan"), -1, True, "lots", [1], "1KiB"):
        with pytest.raises(InvalidArgumentError):
            ResourcePool([1], gpu_memory_cap=bad)
    with pytest.raises(InvalidArgumentError, match="use_gpu=True"):
        ResourcePool([1], use_gpu=False, gpu_memory_cap="fraction")
    with pytest.raises(InvalidArgumentError, match="use_gpu=True"):
        WorkerGroup(ResourcePool([1], use_gpu=False), ClassWithInitArgs(CapProbe), gpu_memory_cap=0.5)


def test_a_malformed_cap_in_worker_env_stops_the_worker_with_the_reason(cap_cluster):
    with pytest.raises(WorkerDiedError, match="PODIUM_GPU_MEMORY_CAP_FRACTION must be a number"):
        WorkerGroup(ResourcePool([1], max_colocate_count=2), ClassWithInitArgs(CapProbe),
                    worker_env={"PODIUM_GPU_MEMORY_CAP_FRACTION": "a third"})
