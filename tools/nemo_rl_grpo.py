"""NeMo-RL's GRPO entry point (``examples/run_grpo.py`` of a checkout), unmodified, under
``podium run`` on a machine without CUDA (issue #49 item 12): run by tools/run-nemo-rl.sh.

The run: ``examples/configs/grpo_math_1B.yaml`` with a tiny offline Llama (Podium's
``build_tiny_llama``, with a chat template) as policy and tokenizer, a four-problem math dataset
written here as JSONL (NeMo-RL's ``ResponseDataset``), one math environment worker, one node of
``--gpus`` "GPUs" (Podium's ``--num-gpus`` counts them: there are none), vLLM generation
colocated with the DTensor policy, as in the example. ``ray`` is Podium's stand-in.

It records the placement groups NeMo-RL makes (a wrapper that calls the real
``placement_group``) and the actors it creates (``ActorClass.remote``), and prints:

- ``REACHED <file>:<line>: <code> -> <error>``: the NeMo-RL line the run stopped at (in the
  remote worker when the error came from one: the innermost NeMo-RL frame of its traceback);
- ``SUMMARY <json>``: the groups (bundles, state), the actors created per class, and the
  interpreters (``py_executable``) they were started with.

Exits 0 when the stop is a GPU-only line (its error names CUDA, NCCL or a GPU), 1 otherwise.
Usage (inside ``podium run``): python tools/nemo_rl_grpo.py CHECKOUT [--gpus N] [OVERRIDE ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import runpy
import sys
import tempfile
import traceback

import ray
import ray.util.placement_group  # noqa: F401 - the module, taken from sys.modules below

#: Errors that mean "this line needs a GPU": torch without CUDA, NCCL, a missing device.
GPU_ONLY = ("CUDA", "cuda", "NCCL", "nccl", "GPU")
#: A remote traceback's frames, as Python prints them.
FRAME = re.compile(r'File "([^"]*/nemo_rl/[^"]*)", line (\d+), in \S+\n\s+(.*)')
#: A chat template for the tiny tokenizer (NeMo-RL's math processor applies one).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
PROBLEMS = [("1 + 1", "2"), ("2 + 3", "5"), ("4 - 1", "3"), ("2 * 3", "6")]

ray_pg = sys.modules["ray.util.placement_group"]
made_groups: list = []
created: collections.Counter = collections.Counter()
interpreters: dict[str, set] = collections.defaultdict(set)


def _record_groups() -> None:
    real = ray_pg.placement_group

    def recording(*args, **kwargs):
        group = real(*args, **kwargs)
        made_groups.append(group)
        return group

    ray_pg.placement_group = recording  # before NeMo-RL's `from ray.util.placement_group import ...`
    ray.util.placement_group = recording


def _record_actors() -> None:
    """Count ``ActorClass.remote`` / ``.options(...).remote`` by class, with their interpreter."""
    actor_class = type(ray.remote(type("Probe", (), {})))
    real_options = actor_class.options
    real_remote = actor_class.remote

    def name_of(cls) -> str:
        meta = getattr(cls, "__ray_metadata__", None)
        return getattr(meta, "class_name", None) or getattr(cls, "__name__", repr(cls))

    def remote(self, *args, **kwargs):
        created[name_of(self)] += 1
        return real_remote(self, *args, **kwargs)

    def options(self, *args, **kwargs):
        env = kwargs.get("runtime_env") or {}
        interpreters[name_of(self)].add(env.get("py_executable") or sys.executable)
        return real_options(self, *args, **kwargs)

    actor_class.remote = remote
    actor_class.options = options


def _write_inputs(work: str) -> tuple[str, str]:
    from podium.rollout.recipes.tinymodel import build_tiny_llama

    model = build_tiny_llama(os.path.join(work, "model"), words=[str(i) for i in range(10)] + list("+-*=") +
                             ["answer", "boxed", "the", "is"])
    config_path = os.path.join(model, "tokenizer_config.json")
    with open(config_path) as f:
        tokenizer_config = json.load(f)
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    with open(config_path, "w") as f:
        json.dump(tokenizer_config, f)
    data = os.path.join(work, "math.jsonl")
    with open(data, "w") as f:
        for problem, answer in PROBLEMS:
            f.write(json.dumps({"problem": problem, "expected_answer": answer}) + "\n")
    return model, data


def _config(checkout: str, work: str, model: str, data: str, gpus: int) -> str:
    path = os.path.join(work, "grpo_tiny.yaml")
    with open(path, "w") as f:
        f.write(f"""defaults: {checkout}/examples/configs/grpo_math_1B.yaml
grpo: {{num_prompts_per_step: 2, num_generations_per_prompt: 2, max_num_steps: 1, val_period: -1}}
checkpointing: {{enabled: false}}
policy:
  model_name: {model}
  train_global_batch_size: 4
  train_micro_batch_size: 2
  max_total_sequence_length: 64
  precision: float32
data:
  train: {{dataset_name: ResponseDataset, data_path: {data}, input_key: problem, output_key: expected_answer}}
  num_workers: 0
env: {{math: {{num_workers: 1}}}}
logger: {{log_dir: {work}/logs, monitor_gpus: false}}
cluster: {{gpus_per_node: {gpus}, num_nodes: 1}}
""")
    return path


def _remote_text(exc: BaseException) -> str:
    """The error's text with the remote tracebacks of it and its causes (a RemoteError's
    ``traceback``), innermost last."""
    parts, seen, cur = [], set(), exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        parts.append(str(cur))
        parts.append(getattr(cur, "traceback", "") or "")
        cur = cur.__cause__ or cur.__context__
    return "\n".join(parts)


def _stop_line(exc: BaseException) -> tuple[str, str, str]:
    remote = FRAME.findall(_remote_text(exc))
    if remote:
        return remote[-1]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/nemo_rl/" in f.filename]
    frame = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    return frame.filename, str(frame.lineno), frame.line or ""


def _summary() -> dict:
    table = ray.util.placement_group_table()
    return {"groups": [{"bundles": len(table[g.id]["bundles"]), "state": table[g.id]["state"]} for g in made_groups],
            "actors": dict(created), "interpreters": {k: sorted(v) for k, v in interpreters.items()}}


def main() -> int:
    """Run examples/run_grpo.py as ``__main__`` and print where it stopped."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkout")
    p.add_argument("--gpus", type=int, default=2)
    args, overrides = p.parse_known_args()
    checkout = os.path.realpath(args.checkout)
    _record_groups()
    _record_actors()
    work = tempfile.mkdtemp(prefix="nemo-rl-")
    model, data = _write_inputs(work)
    config = _config(checkout, work, model, data, args.gpus)
    os.chdir(checkout)  # its prompt files are named relative to the checkout
    sys.argv = [os.path.join(checkout, "examples", "run_grpo.py"), "--config", config, *overrides]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except BaseException as exc:  # noqa: BLE001 - the point is where it stops
        filename, lineno, code = _stop_line(exc)
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
        print(f"REACHED {filename}:{lineno}: {code.strip()} -> {type(exc).__name__}: {message}", flush=True)
        print("SUMMARY " + json.dumps(_summary()), flush=True)
        return 0 if any(word in message for word in GPU_ONLY) else 1
    print("REACHED the end without a GPU (unexpected on a CPU machine)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
