"""Run under ``podium run --num-cpus 16 --num-gpus 6`` on a machine without CUDA, with the CPU
flash-attn stand-in (tests/support/cpu_flash_attn) on PYTHONPATH: OpenRLHF 0.11.2's PPO entry
point (``openrlhf/cli/train_ppo_ray.py``), unmodified, with plain ``import ray`` being Podium's
stand-in. It builds its placement groups and actors as the script does and must stop at the
first line that needs a GPU, not earlier.

The run: a tiny offline Llama as actor, reference, critic and reward model, two "GPUs" per
model, actor and reference colocated (``--train.colocate_actor_ref``: one group of two
bundles made by train_ppo_ray.py, the four actors at 0.2 GPU each), critic and reward each in
a group of their own (made by ``RayActorGroup``), and the PPOTrainer actor reading a
two-prompt dataset. The entry records the groups OpenRLHF makes (a wrapper that calls the real
``placement_group``) and its ``RayActorGroup`` objects, and after the stop calls every actor
(``get_master_addr_port``) to show it was constructed and is alive.

Prints ``IMPORT STOP <file>:<line>: <code> -> <error>`` and exits 3 when OpenRLHF's imports
fail. Else prints ``REACHED <file>:<line>: <code> -> <error>`` for the OpenRLHF line the run
stopped at (in the remote actor where the error came from one) and ``SUMMARY <json>`` (the
groups' table entries, the actors that answered per role, whether the trainer answered), and
exits 0 when that line's error is a GPU-only one, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
import tempfile
import traceback

import ray
import ray.util.placement_group  # noqa: F401 - the module, taken from sys.modules below

assert ray.__podium__

#: Errors that mean "this line needs a GPU": torch without CUDA, NCCL, a missing device.
GPU_ONLY = ("CUDA", "cuda", "NCCL", "nccl", "GPU")
#: A remote traceback's frames, as Python prints them.
FRAME = re.compile(r'File "([^"]*/openrlhf/[^"]*)", line (\d+), in \S+\n\s+(.*)')

#: ``ray.util.placement_group`` the module (the package attribute of that name is the function).
ray_pg = sys.modules["ray.util.placement_group"]
made_groups: list = []
_real_placement_group = ray_pg.placement_group


def _recording_placement_group(*args, **kwargs):
    group = _real_placement_group(*args, **kwargs)
    made_groups.append(group)
    return group


ray_pg.placement_group = _recording_placement_group  # before OpenRLHF's `from ... import placement_group`

try:
    import openrlhf.cli.train_ppo_ray  # noqa: F401 - the entry point's imports, as `python -m` runs them
    from openrlhf.trainer.ray import launcher
except ImportError as exc:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/openrlhf/" in f.filename]
    frame = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    print(f"IMPORT STOP {frame.filename}:{frame.lineno}: {frame.line} -> {exc!r}")
    sys.exit(3)

from podium.rollout.recipes.tinymodel import build_tiny_llama  # noqa: E402

groups: list = []
_real_group_init = launcher.RayActorGroup.__init__


def _recording_group_init(self, *args, **kwargs):
    _real_group_init(self, *args, **kwargs)
    groups.append(self)


launcher.RayActorGroup.__init__ = _recording_group_init

work = tempfile.mkdtemp(prefix="openrlhf-")
model = build_tiny_llama(os.path.join(work, "model"))
prompts = os.path.join(work, "prompts.jsonl")
with open(prompts, "w") as f:
    f.write('{"input": "w1 w2 w3"}\n{"input": "w4 w5"}\n')
os.chdir(work)  # the checkpoint folders it names are relative
sys.argv = ["train_ppo_ray.py", "--actor.model_name_or_path", model, "--reward.model_name_or_path", model,
            "--critic.model_name_or_path", model, "--data.prompt_dataset", prompts, "--vllm.num_engines", "0",
            "--train.colocate_actor_ref", "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2",
            "--critic.num_gpus_per_node", "2", "--reward.num_gpus_per_node", "2",
            "--rollout.batch_size", "2", "--train.batch_size", "2", "--rollout.max_new_tokens", "4",
            "--data.max_len", "32"]


def _stop_line(exc: BaseException) -> tuple[str, str, str]:
    """The deepest OpenRLHF frame: in the remote traceback's text when the error came from an
    actor (the innermost one printed), else in the local traceback."""
    remote = FRAME.findall(str(exc))
    if remote:
        return remote[-1]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/openrlhf/" in f.filename]
    frame = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    return frame.filename, str(frame.lineno), frame.line or ""


def _summary() -> dict:
    table = ray.util.placement_group_table()
    answered = {}
    for group in groups:
        role = group.ray_actor_type.__ray_metadata__.class_name if hasattr(group.ray_actor_type, "__ray_metadata__") \
            else getattr(group.ray_actor_type, "__name__", str(group.ray_actor_type))
        addresses = ray.get([actor.get_master_addr_port.remote() for actor in group._actor_handlers], timeout=60)
        answered[role] = len(addresses)
    return {"groups": [{"bundles": len(table[g.id]["bundles"]), "state": table[g.id]["state"]} for g in made_groups],
            "actors": answered}


try:
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
except BaseException as exc:  # noqa: BLE001 - the point is where it stops
    filename, lineno, code = _stop_line(exc)
    message = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
    print(f"REACHED {filename}:{lineno}: {code.strip()} -> {type(exc).__name__}: {message}")
    print("SUMMARY " + json.dumps(_summary()))
    sys.exit(0 if any(word in message for word in GPU_ONLY) else 1)
print("REACHED the end without a GPU (unexpected on a CPU machine)")
sys.exit(1)
