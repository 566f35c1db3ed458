"""Run under ``podium run --num-cpus 4 --num-gpus 1`` with vLLM's CPU build and a small
``PODIUM_LIVENESS_SECONDS``: OpenRLHF 0.11.2's own ``create_vllm_engines`` (unmodified) starts
its ``RolloutRayActor``, whose ``async def __init__`` builds a vLLM ``AsyncLLMEngine`` (blocking
its loop for longer than the liveness bound), and the engine generates. Prints
``ready: True``, ``generated: N`` and ``OPENRLHF VLLM OK``."""

from __future__ import annotations

import os
import tempfile

import ray
from openrlhf.trainer.ray.vllm_engine import create_vllm_engines
from vllm import SamplingParams

from podium.rollout.recipes.tinymodel import build_tiny_llama

assert ray.__podium__
WAIT_S = 240

model = build_tiny_llama(os.path.join(tempfile.mkdtemp(prefix="openrlhf-vllm-"), "model"))
engines = create_vllm_engines(1, 1, model, seed=42, full_determinism=False, enable_prefix_caching=False,
                              enforce_eager=True, max_model_len=64, gpu_memory_utilization=0.05)
print("ready:", ray.get(engines[0].__ray_ready__.remote(), timeout=WAIT_S), flush=True)
out = ray.get(engines[0].generate.remote([1, 5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0)),
              timeout=WAIT_S)
print("generated:", len(out.outputs[0].token_ids), flush=True)
print("unfinished:", ray.get(engines[0].get_num_unfinished_requests.remote(), timeout=WAIT_S))
print("OPENRLHF VLLM OK")
