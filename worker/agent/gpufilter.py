"""Offer only some of a node's GPUs: the ones a batch system gave this job.

NVML lists every GPU in the machine, whatever ``CUDA_VISIBLE_DEVICES`` says. Under
Slurm (and any scheduler that shares a node between jobs) the node agent must hand
out only the GPUs of its allocation, which the batch system names in
``CUDA_VISIBLE_DEVICES``: NVML indices ("0,3") or UUIDs ("GPU-8f2e...", "MIG-...").
:class:`VisibleGpus` wraps a provider and keeps those. The GPUs keep their NVML
indices, so the ``CUDA_VISIBLE_DEVICES`` the agent gives each worker (with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``) names the same devices.
"""

from __future__ import annotations

from podium.errors import InvalidArgumentError
from podium.worker.agent.gpus import Gpu, GpuProvider, ProcessUsage

__all__ = ["VisibleGpus", "parse_visible_devices"]

#: What CUDA and Slurm write when a job has no GPU at all.
_NO_DEVICES = ("", "NoDevFiles", "none", "-1")


def parse_visible_devices(value: str | None) -> tuple[str, ...] | None:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value; None when it is unset (every GPU),
    () when it selects none ("", "NoDevFiles", "-1"). InvalidArgumentError on an entry
    that is neither an index nor a GPU-/MIG- UUID."""
    if value is None:
        return None
    value = value.strip()
    if value in _NO_DEVICES:
        return ()
    entries = tuple(item.strip() for item in value.split(","))
    for item in entries:
        if not (item.isdigit() or item.startswith(("GPU-", "MIG-"))):
            raise InvalidArgumentError(
                f"CUDA_VISIBLE_DEVICES={value!r}: {item!r} is neither a GPU index nor a GPU-/MIG- UUID")
    if len(set(entries)) != len(entries):
        raise InvalidArgumentError(f"CUDA_VISIBLE_DEVICES={value!r} names a GPU twice")
    return entries


class VisibleGpus:
    """A provider that keeps the GPUs ``visible`` names (indices or UUID prefixes, as CUDA
    accepts) and the processes on them; ``visible=None`` keeps them all."""

    def __init__(self, inner: GpuProvider, visible: tuple[str, ...] | None) -> None:
        self._inner = inner
        self._visible = visible

    def _keeps(self, gpu: Gpu) -> bool:
        if self._visible is None:
            return True
        return any(item == str(gpu.index) if item.isdigit() else gpu.uuid.startswith(item)
                   for item in self._visible)

    def gpus(self) -> list[Gpu]:
        """The inner provider's GPUs that are visible, in index order."""
        return [g for g in self._inner.gpus() if self._keeps(g)]

    def processes(self) -> list[ProcessUsage]:
        """Device memory per (process, GPU), visible GPUs only."""
        kept = {g.uuid for g in self.gpus()}
        return [p for p in self._inner.processes() if p.gpu_uuid in kept]

    def close(self) -> None:
        """Close the inner provider."""
        self._inner.close()
