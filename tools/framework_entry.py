"""Run a framework's training entry point from a checkout under ``podium run`` with a tiny
offline model and config, and print the first line it stops at (issue #49 item 12).

Usage: python tools/framework_entry.py CHECKOUT --framework roll|slime [--keep] [--timeout S]
(in the framework's environment: tools/install-roll.sh / tools/install-slime.sh make
.venv-roll / .venv-slime). It measures: nothing in the checkout is changed.

* roll: ``examples/start_rlvr_pipeline.py`` with tools/framework_configs/roll_rlvr_tiny.yaml
  (the shape of ROLL's qwen3-8B FSDP2 example at one device per role), in a fresh folder, with
  no cluster given: ROLL's launcher runs ``ray start --head`` (Podium's ``ray`` command) on a
  free port, joins it, follows its workers' logs with its ``LogMonitor`` subclass, and builds
  its pipeline.
* slime: ``train.py`` with a tiny offline Llama, four prompts and Megatron arguments at the same
  size, training and rollout colocated on one fake GPU (``podium run --num-gpus 1``), Megatron-LM
  on ``PYTHONPATH`` (the caller's): it creates its placement group, its GPU-id probe actors, its
  rollout manager and its SGLang engine actors (fractional GPUs in the bundle, with
  ``RAY_EXPERIMENTAL_NOSET_*_VISIBLE_DEVICES``). No ``--probe-cuda`` here: Megatron-LM queries the
  device's capability at import when torch reports CUDA.

Prints ``REACHED <file>:<line>: <code> -> <error>`` for the deepest line of the framework's code
in the last traceback the run printed (a remote one where the error came from an actor), then
the last lines of the run's output; the exit status is the run's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: A traceback frame as Python prints it.
FRAME = re.compile(r'File "([^"]+)", line (\d+), in \S+\n(?:\s+(.*)\n)?')
#: The prefix Ray's (and ROLL's) log monitor puts before each line of a worker.
PREFIX = re.compile(r"^\([^()\n]* pid=\d+(?:, ip=[^)\n]*)?\) ", re.M)
#: The last line of a traceback: ``SomeError: message``.
ERROR = re.compile(r"^(\w[\w.]*(?:Error|Exception|Exit|Interrupt)\b.*)$", re.M)


def free_port() -> int:
    """A port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepare_roll(checkout: Path, work: Path) -> tuple[list[str], dict[str, str], list[str]]:
    """ROLL's RLVR entry: the model, the data, the config; the command, its env, podium run's flags."""
    from podium.rollout.recipes.tinymodel import build_tiny_llama

    model = build_tiny_llama(work / "model")
    with open(work / "prompts.jsonl", "w") as f:
        for words, answer in (("w1 w2 w3 w4 w5 w6 w7", "7"), ("w8 w9 w10 w11 w12 w13", "6"),
                              ("w14 w15 w16 w17 w18", "5"), ("w19 w20 w21 w22 w23 w24", "6")):
            f.write(json.dumps({"messages": json.dumps([{"role": "user", "content": words}]),
                                "tag": "deepmath_103k", "ground_truth": answer}) + "\n")
    config = (HERE / "framework_configs" / "roll_rlvr_tiny.yaml").read_text()
    (work / "config").mkdir()
    (work / "config" / "rlvr_tiny.yaml").write_text(config.replace("@MODEL@", model).replace("@WORK@", str(work)))
    entry = checkout / "examples" / "start_rlvr_pipeline.py"
    # Hydra takes the config folder relative to the entry script's folder.
    rel = os.path.relpath(work / "config", entry.parent)
    env = {"MASTER_PORT": str(free_port()), "DASHBOARD_PORT": str(free_port()), "PODIUM_RAY_DIR": str(work / "ray"),
           "PODIUM_TOKEN": "framework-entry-" + os.urandom(8).hex()}
    return [sys.executable, str(entry), "--config_path", rel, "--config_name", "rlvr_tiny"], env, ["--num-cpus", "16"]


def prepare_slime(checkout: Path, work: Path) -> tuple[list[str], dict[str, str], list[str]]:
    """slime's ``train.py``: a tiny Llama, four prompts, Megatron arguments at the smallest size, one
    colocated GPU for training and rollout; the command, its env, podium run's flags."""
    from podium.rollout.recipes.tinymodel import build_tiny_llama

    model = build_tiny_llama(work / "model")
    with open(work / "prompts.jsonl", "w") as f:
        for words, answer in (("w1 w2 w3", "3"), ("w4 w5", "2"), ("w6 w7 w8 w9", "4"), ("w10", "1")):
            f.write(json.dumps({"prompt": words, "label": answer}) + "\n")
    tiny_megatron = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads",
                     "2", "--swiglu", "--normalization", "RMSNorm", "--use-rotary-position-embeddings",
                     "--disable-bias-linear", "--vocab-size", "32", "--seq-length", "64",
                     "--max-position-embeddings", "256", "--micro-batch-size", "1",
                     "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-6", "--rotary-base", "10000"]
    slime = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--colocate", "--hf-checkpoint", model,
             "--prompt-data", str(work / "prompts.jsonl"), "--input-key", "prompt", "--label-key", "label",
             "--rm-type", "deepscaler", "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt",
             "2", "--global-batch-size", "4", "--rollout-max-response-len", "8", "--rollout-num-gpus-per-engine", "1",
             "--advantage-estimator", "grpo", "--optimizer", "adam", "--lr", "1e-6"]
    env = {"PODIUM_RAY_DIR": str(work / "ray"), "PODIUM_TOKEN": "framework-entry-" + os.urandom(8).hex()}
    # One fake GPU: its placement group asks {"GPU": 1, "CPU": 1} per bundle.
    return [sys.executable, str(checkout / "train.py"), *tiny_megatron, *slime], env, ["--num-cpus", "16", "--num-gpus", "1"]


#: ``--probe-cuda N``: torch reports N CUDA devices (tools/framework_configs/cuda_probe).
CUDA_PROBE = HERE / "framework_configs" / "cuda_probe"


PREPARE = {"roll": prepare_roll, "slime": prepare_slime}


def stop_line(out: str, checkout: Path) -> str:
    """``file:line: code -> error`` of the deepest checkout frame in the last traceback."""
    out = PREFIX.sub("", out)  # a worker's lines as a log monitor prints them: "(name pid=N, ip=A) line"
    start = out.rfind("Traceback (most recent call last)")
    if start < 0:
        return "no traceback in the output"
    tail = out[start:]
    frames = [(f, n, c or "") for f, n, c in FRAME.findall(tail) if f.startswith(str(checkout))]
    errors = ERROR.findall(tail)
    error = errors[-1] if errors else tail.strip().splitlines()[-1]
    if not frames:
        return f"(no frame of the checkout) -> {error}"
    f, n, code = frames[-1]
    return f"{f[len(str(checkout)):].lstrip('/')}:{n}: {code.strip()} -> {error}"[:600]


def main() -> int:
    """Prepare, run under ``podium run``, print where it stopped; returns the run's status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkout")
    p.add_argument("--framework", choices=sorted(PREPARE), required=True)
    p.add_argument("--keep", action="store_true", help="keep the work folder (its path is printed; run.log holds the "
                                                         "run's whole output)")
    p.add_argument("--probe-cuda", type=int, default=0, metavar="N",
                   help="torch reports N CUDA devices (is_available, device_count, get_device_name only), so a "
                        "framework that picks its platform from torch takes its GPU path; ray start's node "
                        "offers N fake GPUs")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the run may take (at most 3600)")
    args = p.parse_args()
    if not 1 <= args.timeout <= 3600:
        p.error("--timeout must be in [1, 3600]")
    if not 0 <= args.probe_cuda <= 64:
        p.error("--probe-cuda must be in [0, 64]")
    if args.probe_cuda and args.framework == "slime":
        p.error("slime runs without --probe-cuda (Megatron-LM queries the device's capability at import when torch "
                "reports CUDA); its run already offers one fake GPU")
    checkout = Path(args.checkout).resolve()
    work = Path(tempfile.mkdtemp(prefix=f"podium-{args.framework}-"))
    command, extra_env, run_flags = PREPARE[args.framework](checkout, work)
    env = {k: v for k, v in os.environ.items() if k not in ("PODIUM_ADDRESS", "PODIUM_TOKEN_FILE")}
    paths = [str(CUDA_PROBE)] if args.probe_cuda else []
    if args.probe_cuda:
        extra_env.update(PODIUM_PROBE_CUDA_DEVICES=str(args.probe_cuda))
        run_flags = [*run_flags, "--num-gpus", str(args.probe_cuda)]
    env.update(extra_env, PYTHONPATH=os.pathsep.join(x for x in (*paths, str(checkout), os.environ.get("PYTHONPATH")) if x),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    try:
        run = subprocess.run([sys.executable, "-m", "podium.cli", "run", *run_flags, "--", *command], cwd=work,
                             env=env, capture_output=True, text=True, timeout=args.timeout)
        out, code = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        out, code = out + f"\n(timed out after {args.timeout:g} s)", 124
    finally:  # whatever the framework's ray start started stops with the run
        subprocess.run([sys.executable, "-m", "podium.compat.raycli", "stop", "--force"], env=env,
                       capture_output=True, timeout=120)
    (work / "run.log").write_text(out)  # the whole output, for --keep
    print("\n".join(out.strip().splitlines()[-40:]))
    print(f"REACHED {stop_line(out, checkout)}")
    if args.keep:
        print(f"work folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
