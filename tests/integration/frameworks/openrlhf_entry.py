"""Run under ``podium run --num-cpus 16 --num-gpus 2`` on a machine without CUDA: OpenRLHF
0.11.2's PPO entry point (``openrlhf/cli/train_ppo_ray.py``), unmodified, with plain ``import
ray`` being Podium's stand-in. It builds its placement groups and actors as the script does and
must stop at the first line that needs a GPU, not earlier.

Prints ``IMPORT STOP <file>:<line>: <code> -> <error>`` and exits 3 when a CUDA-only package
stops OpenRLHF's imports (flash-attn has no CPU build); else ``REACHED <file>:<line>: <code>
-> <error>`` for the line the run stopped at, and exits 0 when that line is a GPU-only one.
"""

from __future__ import annotations

import runpy
import sys
import tempfile
import traceback

import ray

assert ray.__podium__

#: Errors that mean "this line needs a GPU": torch without CUDA, NCCL, a missing device.
GPU_ONLY = ("CUDA", "cuda", "NCCL", "nccl", "GPU")


def _last_openrlhf_frame(exc: BaseException) -> traceback.FrameSummary:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/openrlhf/" in f.filename]
    return frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]


try:
    import openrlhf.cli.train_ppo_ray  # noqa: F401 - the entry point's imports, as `python -m` runs them
except ImportError as exc:
    frame = _last_openrlhf_frame(exc)
    print(f"IMPORT STOP {frame.filename}:{frame.lineno}: {frame.line} -> {exc!r}")
    sys.exit(3)

from podium.rollout.tinymodel import build_tiny_llama  # noqa: E402

model = build_tiny_llama(tempfile.mkdtemp(prefix="openrlhf-"))
sys.argv = ["train_ppo_ray.py", "--actor.model_name_or_path", model, "--actor.num_nodes", "1",
            "--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1", "--reward.num_gpus_per_node", "1",
            "--critic.num_gpus_per_node", "1", "--vllm.num_engines", "0", "--reward.model_name_or_path", model]
try:
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
except BaseException as exc:  # noqa: BLE001 - the point is where it stops
    frame = _last_openrlhf_frame(exc)
    print(f"REACHED {frame.filename}:{frame.lineno}: {frame.line} -> {exc!r}")
    sys.exit(0 if any(word in repr(exc) for word in GPU_ONLY) else 1)
print("REACHED the end without a GPU (unexpected on a CPU machine)")
sys.exit(1)
