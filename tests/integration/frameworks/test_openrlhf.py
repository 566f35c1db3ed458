"""OpenRLHF 0.11.2's PPO entry point, unmodified, under ``podium run`` on CPU (issue #49
item 12): it imports its trainer and controller modules and builds its placement groups and
actors as ``openrlhf/cli/train_ppo_ray.py`` does, up to its first GPU-only line
(openrlhf_entry.py); and its vLLM engine actor, built by its own ``create_vllm_engines`` on
vLLM's CPU build, constructed and generating (openrlhf_vllm_program.py). Needs the OpenRLHF wheel: ``tools/install-openrlhf.sh`` makes
.venv-openrlhf.

flash-attn, which OpenRLHF imports at module level, has no CPU build; the run puts a pure-torch
stand-in for the names it imports (tests/support/cpu_flash_attn) on PYTHONPATH, here only, so
the run gets past the imports to the first line that needs a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FLASH_ATTN_STANDIN = HERE.parents[1] / "support" / "cpu_flash_attn"
HAVE_OPENRLHF = importlib.util.find_spec("openrlhf") is not None
pytestmark = [pytest.mark.openrlhf,
              pytest.mark.skipif(not HAVE_OPENRLHF, reason="openrlhf is not installed (tools/install-openrlhf.sh "
                                                           "makes .venv-openrlhf with the OpenRLHF 0.11.2 wheel)"),
              pytest.mark.timeout(300)]


def test_ppo_entry_point_builds_its_groups_and_actors_and_stops_at_its_first_gpu_only_line():
    env = {k: v for k, v in os.environ.items() if k != "PODIUM_ADDRESS"}
    env["PYTHONPATH"] = str(FLASH_ATTN_STANDIN)
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "16", "--num-gpus", "6", "--",
                          sys.executable, str(HERE / "openrlhf_entry.py")], env=env, capture_output=True, text=True,
                         timeout=280)
    out = run.stdout + run.stderr
    assert "IMPORT STOP" not in out, out[-4000:]
    reached = [line for line in out.splitlines() if line.startswith("REACHED ")]
    summaries = [line for line in out.splitlines() if line.startswith("SUMMARY ")]
    assert run.returncode == 0 and reached and summaries, out[-4000:]
    # The first GPU-only line: DeepSpeed strategy's setup_distributed picks the actor's CUDA
    # device, inside the first actor's init_model_from_pretrained; CPU torch has no CUDA calls.
    assert "openrlhf/utils/deepspeed/deepspeed.py:" in reached[0], reached[0]
    assert "torch.cuda.set_device(local_rank)" in reached[0], reached[0]
    assert "_cuda_setDevice" in reached[0], reached[0]
    summary = json.loads(summaries[0][len("SUMMARY "):])
    # Three groups of two bundles, all placed: actor+reference (train_ppo_ray.py), critic and
    # reward (RayActorGroup, one each).
    assert summary["groups"] == [{"bundles": 2, "state": "CREATED"}] * 3, summary
    # Two ranks of each model were constructed and answer a call.
    assert summary["actors"] == {"PolicyModelActor": 2, "ReferenceModelActor": 2, "CriticModelActor": 2,
                                 "RewardModelActor": 2}, summary


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vllm is not installed (tools/install-openrlhf.sh installs vLLM's CPU build)")
def test_openrlhfs_vllm_engine_actor_builds_its_engine_in_an_async_init_and_generates():
    # RolloutRayActor's async __init__ builds a vLLM AsyncLLMEngine, blocking its loop for longer
    # than PODIUM_LIVENESS_SECONDS=2: the actor's loop is not the worker's I/O loop, so it is
    # waited for (as Ray does), not declared dead (openrlhf_vllm_program.py).
    env = {k: v for k, v in os.environ.items() if k != "PODIUM_ADDRESS"}
    env.update(PYTHONPATH=str(FLASH_ATTN_STANDIN), PODIUM_LIVENESS_SECONDS="2", VLLM_CPU_KVCACHE_SPACE="1")
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "4", "--num-gpus", "1", "--",
                          sys.executable, str(HERE / "openrlhf_vllm_program.py")], env=env, capture_output=True,
                         text=True, timeout=280)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "OPENRLHF VLLM OK" in run.stdout, out[-4000:]
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert (lines.get("ready"), lines.get("generated"), lines.get("unfinished")) == ("True", "4", "0"), out[-4000:]
