"""GPU-only behaviour of the vLLM rollout: sleep/wake_up release and restore GPU memory.

Runs where CUDA and the GPU build of vLLM are present (marker ``gpu``); skipped, naming
CUDA, elsewhere. The memory is NVML's per-process reading for the worker's pid, the same
number the node agent puts in ``/v1/placement``.
"""

from __future__ import annotations

import time

import pytest

from tests.support.rollout_kit import HAVE_VLLM, NO_VLLM, prompt_batch

try:
    import torch

    HAVE_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a dependency
    HAVE_CUDA = False

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM),
              pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA (an NVIDIA GPU): vLLM sleep mode is GPU only"),
              pytest.mark.timeout(600)]


def _gpu_bytes_of(pid: int) -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        total = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory:
                    total += proc.usedGpuMemory
        return total
    finally:
        pynvml.nvmlShutdown()


def _settled(pid: int, want_low: bool, bound: int, deadline_s: float = 30.0) -> int:
    # NVML's per-process figure lags the free by a moment: poll, with a deadline.
    end = time.monotonic() + deadline_s
    while True:
        used = _gpu_bytes_of(pid)
        if (used < bound) == want_low or time.monotonic() > end:
            return used
        time.sleep(0.2)


def test_sleep_releases_and_wake_restores_gpu_memory(tmp_path):
    import podium
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.rollout.recipes.tinymodel import LLAMA_100M, build_tiny_llama
    from podium.rollout.vllm import VLLMRollout

    model_dir = build_tiny_llama(tmp_path / "m100", seed=0, **LLAMA_100M)
    cfg = dict(model_path=model_dir, n=2, max_tokens=8, max_model_len=256, dtype="bfloat16",
               kv_cache_memory_bytes=1 << 30)
    podium.init()
    try:
        wg = WorkerGroup(ResourcePool([1], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(VLLMRollout, cfg))
        try:
            info = wg.init_model()[0]
            assert info["device"] == "cuda"
            pid = info["pid"]
            awake = _gpu_bytes_of(pid)
            assert awake > (1 << 30)  # at least the KV cache
            assert wg.sleep(level=1) == [True]
            asleep = _settled(pid, want_low=True, bound=awake - (1 << 30) // 2)
            assert wg.wake_up() == [True]
            woke = _settled(pid, want_low=False, bound=awake - (1 << 30) // 2)
            print(f"GPU memory of the rollout worker: awake {awake / 2**20:.0f} MiB, asleep "
                  f"{asleep / 2**20:.0f} MiB, woken {woke / 2**20:.0f} MiB")
            assert asleep < awake - (1 << 30) // 2 < woke
            out = wg.generate_sequences(prompt_batch([[1, 4, 5], [1, 6]]))
            assert len(out) == 4
        finally:
            wg.shutdown()
    finally:
        podium.shutdown()
