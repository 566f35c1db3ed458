"""vLLM's Ray executor (``distributed_executor_backend="ray"``, RayExecutorV2) on Podium's ray
stand-in with vLLM's CPU build: a tiny Llama, tensor parallel ``TP`` (default 1), one generate.

vLLM's CPU platform does not support its Ray executor (``CpuPlatform.ray_device_key`` is "":
``ValueError: current platform cpu does not support ray``, vllm/v1/executor/ray_utils.py:574),
so the ``sitecustomize.py`` beside this file, with ``SHIM_DEVICE_KEY=1``, gives it a custom
resource ``cpu_device`` (which the embedded node offers through ``ray.init(resources=...)``) and
lists it in ``get_accelerator_ids()``,
where the stand-in lacks it. Everything else is vLLM's and Podium's own code. Run (workers must
start fresh, so that sitecustomize runs in them):

    PYTHONPATH=tools/vllm_ray_cpu PODIUM_FORKSERVER=0 SHIM_DEVICE_KEY=1 TP=2 \\
        .venv-vllm/bin/python -m podium.cli run --num-cpus 8 -- .venv-vllm/bin/python tools/vllm_ray_cpu/run.py

Prints ``VLLM RAY OK`` and the generated token ids.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import ray  # noqa: E402 - after the vLLM setting above

from podium.rollout.tinymodel import build_tiny_llama  # noqa: E402


def main() -> None:
    """Build the model, start the engine on Ray's executor, generate once."""
    path = build_tiny_llama(tempfile.mkdtemp(prefix="tiny-"))
    ray.init(resources={"cpu_device": 2} if os.environ.get("SHIM_DEVICE_KEY") else None)
    from vllm import LLM, SamplingParams
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=128,
              kv_cache_memory_bytes=64 * 2**20, distributed_executor_backend="ray",
              tensor_parallel_size=int(os.environ.get("TP", "1")))
    out = llm.generate(["w1 w2 w3"], SamplingParams(max_tokens=4))
    print("VLLM RAY OK", list(out[0].outputs[0].token_ids))


if __name__ == "__main__":
    main()
