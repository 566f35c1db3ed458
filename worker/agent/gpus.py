"""GPU inventory for the node agent: NVML when there are GPUs, a fake provider when asked.

The agent reads two things: the GPUs (index, UUID, name, total and used memory)
and which processes hold device memory where. :class:`NvmlProvider` asks NVML
(``nvidia-ml-py``); :class:`FakeProvider` invents stable GPUs so a laptop or CI
box can play a GPU cluster (``podium node --fake-gpus 8``). :func:`detect`
picks one. Nothing here imports torch: the agent must stay light.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import uuid
from typing import NamedTuple, Protocol

from podium.errors import InvalidArgumentError

log = logging.getLogger(__name__)

#: Default memory of a fake GPU (an 80 GB H100-class card).
DEFAULT_FAKE_MEMORY = 80 * 1024**3

#: Namespace of the fake UUIDs, so the same node id and index give the same UUID every run.
_FAKE_NAMESPACE = uuid.UUID("6f1c2b1e-4a70-4c55-9f62-706f6469756d")


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU as a provider reads it (mirrors ``podium.v1.GpuInfo``)."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int


class ProcessUsage(NamedTuple):
    """Device memory one process holds on one GPU."""

    pid: int
    gpu_uuid: str
    used_bytes: int


class GpuProvider(Protocol):
    """Where the agent's GPU readings come from."""

    def gpus(self) -> list[Gpu]:
        """The GPUs in index order, with fresh memory readings."""

    def processes(self) -> list[ProcessUsage]:
        """Device memory per (process, GPU)."""

    def close(self) -> None:
        """Release the provider (NVML shutdown); safe to call twice."""


class FakeProvider:
    """``count`` made-up GPUs of ``memory_bytes`` each; no process ever uses them.

    UUIDs derive from ``node_id`` and the index, so a restarted agent reports the
    same GPUs and two fake nodes never share a UUID.
    """

    def __init__(self, count: int, memory_bytes: int = DEFAULT_FAKE_MEMORY, node_id: str = "") -> None:
        if count < 0:
            raise InvalidArgumentError(f"fake GPU count must be >= 0, got {count}")
        if memory_bytes <= 0:
            raise InvalidArgumentError(f"fake GPU memory must be > 0, got {memory_bytes}")
        self._gpus = [Gpu(index=i, uuid=fake_uuid(node_id, i), name="Fake GPU",
                          memory_total_bytes=memory_bytes, memory_used_bytes=0)
                      for i in range(count)]

    def gpus(self) -> list[Gpu]:
        """The fake GPUs (memory used is always 0)."""
        return list(self._gpus)

    def processes(self) -> list[ProcessUsage]:
        """Always empty: nothing runs on a fake GPU."""
        return []

    def close(self) -> None:
        """Nothing to release."""


def fake_uuid(node_id: str, index: int) -> str:
    """The stable UUID of fake GPU ``index`` on node ``node_id`` ("GPU-<uuid5>")."""
    return f"GPU-{uuid.uuid5(_FAKE_NAMESPACE, f'{node_id}/{index}')}"


def _text(value) -> str:
    # Older NVML bindings return bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlProvider:
    """Readings from NVML. Initialises once (raises ``pynvml.NVMLError`` if it cannot);
    afterwards every per-GPU failure is logged and skipped, so one sick GPU (fallen
    off the bus, ECC storm) never takes the agent down.
    """

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._closed = False
        # Static facts per index, read once; only memory is read every time.
        self._static: dict[int, tuple[str, str, int]] = {}
        self._last_used: dict[int, int] = {}

    def _handles(self):
        nvml = self._nvml
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            log.warning("NVML: cannot count devices: %s", exc)
            return
        for index in range(count):
            try:
                yield index, nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError as exc:
                log.warning("NVML: GPU %d unavailable: %s", index, exc)

    def gpus(self) -> list[Gpu]:
        """Every GPU NVML can still read; memory used falls back to the last reading."""
        nvml = self._nvml
        out = []
        for index, handle in self._handles():
            try:
                if index not in self._static:
                    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                    self._static[index] = (_text(nvml.nvmlDeviceGetUUID(handle)),
                                           _text(nvml.nvmlDeviceGetName(handle)), int(memory.total))
                    self._last_used[index] = int(memory.used)
                else:
                    self._last_used[index] = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except nvml.NVMLError as exc:
                log.warning("NVML: cannot read GPU %d: %s", index, exc)
                if index not in self._static:
                    continue
            gpu_uuid, name, total = self._static[index]
            out.append(Gpu(index=index, uuid=gpu_uuid, name=name, memory_total_bytes=total,
                           memory_used_bytes=self._last_used.get(index, 0)))
        return out

    def processes(self) -> list[ProcessUsage]:
        """Compute processes per GPU (usedGpuMemory is None where the driver hides it: 0)."""
        nvml = self._nvml
        out = []
        for index, handle in self._handles():
            try:
                gpu_uuid = self._static[index][0] if index in self._static else _text(
                    nvml.nvmlDeviceGetUUID(handle))
                for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = getattr(proc, "usedGpuMemory", None)
                    out.append(ProcessUsage(int(proc.pid), gpu_uuid, int(used or 0)))
            except nvml.NVMLError as exc:
                log.warning("NVML: cannot list processes on GPU %d: %s", index, exc)
        return out

    def close(self) -> None:
        """Shut NVML down once."""
        if self._closed:
            return
        self._closed = True
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:  # shutting down: nothing left to protect
            log.debug("NVML shutdown: %s", exc)


def detect(fake_gpus: int | None, *, fake_memory_bytes: int = DEFAULT_FAKE_MEMORY,
           node_id: str = "") -> GpuProvider:
    """The provider for this machine.

    ``fake_gpus`` set (even 0): a :class:`FakeProvider`. Otherwise NVML when it
    initialises, else zero GPUs (a CPU-only node) with a log line saying why.
    """
    if fake_gpus is not None:
        return FakeProvider(fake_gpus, fake_memory_bytes, node_id)
    try:
        import pynvml

        try:
            return NvmlProvider()
        except pynvml.NVMLError as exc:
            log.info("no NVIDIA GPUs on this node (NVML: %s); offering CPUs only", exc)
    except ImportError:
        log.info("nvidia-ml-py is not installed; offering CPUs only")
    return FakeProvider(0, node_id=node_id)


_UNITS = {"": 1, "b": 1,
          "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
          "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in a size like "80GiB", "512 MiB", "1.5GB" or "1024" (KB/MB/GB are powers of
    1000, KiB/MiB/GiB powers of 1024, as on the GPU's spec sheet)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidArgumentError(f"size must be >= 0, got {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidArgumentError(
            f"bad size {text!r}: use a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return int(float(match.group(1)) * _UNITS[unit])
