"""NVML from the real library (podium.worker.agent.gpus.NvmlProvider): the inventory agrees with
what CUDA reports, and memory this process allocates shows up as per-process usage."""

from __future__ import annotations

import os

import pytest
import torch

from podium.worker.agent.gpus import NvmlProvider, detect
from tests.support.waiting import eventually

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def _uuid(index: int) -> str:
    # torch prints the UUID without NVML's "GPU-" prefix.
    return "GPU-" + str(torch.cuda.get_device_properties(index).uuid).removeprefix("GPU-")


def test_inventory_matches_cuda():
    provider = NvmlProvider()
    try:
        gpus = provider.gpus()
        assert len(gpus) >= torch.cuda.device_count() >= 1
        assert [g.index for g in gpus] == list(range(len(gpus)))
        by_uuid = {g.uuid: g for g in gpus}
        assert len(by_uuid) == len(gpus)
        for g in gpus:
            assert g.uuid.startswith("GPU-") and g.name and 0 <= g.memory_used_bytes <= g.memory_total_bytes
        for index in range(torch.cuda.device_count()):
            gpu = by_uuid[_uuid(index)]
            total = torch.cuda.get_device_properties(index).total_memory
            # CUDA's total leaves out what the driver reserves: a few percent below NVML's.
            assert 0.9 * gpu.memory_total_bytes <= total <= gpu.memory_total_bytes
        detected = detect(None)
        assert isinstance(detected, NvmlProvider)
        detected.close()
    finally:
        provider.close()
        provider.close()  # twice is fine


def test_per_process_memory_shows_this_process():
    provider = NvmlProvider()
    size = 512 << 20
    block = torch.empty(size, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    uuid = _uuid(0)
    try:
        def ours() -> list:
            return [p for p in provider.processes() if p.gpu_uuid == uuid and p.pid == os.getpid()
                    and p.used_bytes >= size]

        # In a container NVML may report host pids, which Podium cannot map to workers: this fails then.
        eventually(ours, f"NVML listing pid {os.getpid()} with {size} bytes on {uuid}", timeout=20, interval=0.5)
        used_before = next(g for g in provider.gpus() if g.uuid == uuid).memory_used_bytes
        assert used_before >= size
    finally:
        del block
        provider.close()
