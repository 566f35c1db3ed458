"""The GPU memory cap enforced on a real GPU: applied before the constructor, an allocation
under it works, one above it fails with an out-of-memory error naming the cap, and
/v1/placement shows the cap beside NVML's reading of the worker's memory."""

from __future__ import annotations

import pytest
import torch

from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.errors import RemoteError
from podium.worker import Dispatch, Worker, register

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


class Capped(Worker):
    """Allocates on demand; remembers the cap as its constructor found it."""

    def __init__(self):
        super().__init__()
        from podium.worker.host import gpucap
        report = gpucap.current()
        self.at_construct = {"applied": report.applied, "cap_bytes": report.cap_bytes, "detail": report.detail,
                             "total": torch.cuda.get_device_properties(0).total_memory}
        self.blocks = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def seen(self):
        return self.at_construct

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def allocate(self, nbytes):
        self.blocks.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda:0"))
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated(0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def free(self):
        self.blocks.clear()
        torch.cuda.empty_cache()


def test_fraction_cap_is_enforced_and_named(gpu_cluster):
    group = WorkerGroup(ResourcePool([1], max_colocate_count=3, gpu_memory_cap="fraction"), ClassWithInitArgs(Capped))
    try:
        [seen] = group.seen()
        assert seen["applied"], seen["detail"]
        assert seen["cap_bytes"] == pytest.approx(seen["total"] / 3, abs=2)
        assert group.allocate(256 << 20)[0] >= 256 << 20
        [(gpu, worker)] = gpu_cluster.wait_memory(group.name_prefix, 256 << 20)
        # The cap beside NVML's reading of this worker's memory (NVML's total is the card's).
        assert worker["memory_cap"]["text"] == "1/3"
        assert worker["memory_cap"]["bytes"] == pytest.approx(gpu["memory_total_bytes"] / 3, abs=2)
        assert worker["memory_used_bytes"] < worker["memory_cap"]["bytes"]
        with pytest.raises(RemoteError) as info:
            group.allocate(seen["total"] // 2)  # above a third of the GPU
        message = str(info.value)
        assert info.value.remote_type == "torch.OutOfMemoryError"
        assert "Podium GPU memory cap of 1/3 of the GPU" in message and "enforced" in message, message
        group.free()
        assert group.allocate(256 << 20)[0] >= 256 << 20  # the worker lives on after the OOM
    finally:
        group.shutdown()


def test_byte_cap_is_enforced(gpu_cluster):
    group = WorkerGroup(ResourcePool([1], max_colocate_count=2), ClassWithInitArgs(Capped), gpu_memory_cap="1GiB")
    try:
        [seen] = group.seen()
        assert seen["applied"] and abs(seen["cap_bytes"] - (1 << 30)) < (1 << 20), seen
        group.allocate(512 << 20)
        with pytest.raises(RemoteError, match="Podium GPU memory cap of 1.0 GiB per GPU"):
            group.allocate(1 << 30)
        [(_, worker)] = gpu_cluster.workers_of(group.name_prefix)
        assert worker["memory_cap"]["bytes"] == 1 << 30
    finally:
        group.shutdown()


def test_without_a_cap_the_same_allocation_fits(gpu_cluster):
    group = WorkerGroup(ResourcePool([1], max_colocate_count=3), ClassWithInitArgs(Capped))
    try:
        [seen] = group.seen()
        assert not seen["applied"] and seen["detail"] == "no cap asked"
        assert group.allocate(seen["total"] // 2)[0] >= seen["total"] // 2
    finally:
        group.shutdown()
