"""``podium run [--address HOST:PORT] [--num-cpus N] [--num-gpus N] [--native-verl] -- COMMAND...``:
run COMMAND with ``import ray`` resolving to Podium's stand-in (``podium.compat.raypath``).

COMMAND's environment gets the stand-in's folder first on ``PYTHONPATH``, so COMMAND's
process and every worker, task and actor process Podium starts for it import the stand-in;
a real Ray installed in the same environment is untouched and is what ``import ray`` finds
outside ``podium run``. ``--address`` (else ``PODIUM_ADDRESS``) is the cluster the first
``ray.init()`` joins; without one it starts the embedded cluster, ``--num-cpus`` CPUs and
``--num-gpus`` GPUs (fake ones where NVML finds none). ``--native-verl`` also makes
``verl.single_controller.ray`` Podium's own worker groups (:mod:`podium.compat.nativeverl`).
The exit status is COMMAND's.
From Python (a notebook): :func:`podium.compat.activate`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from podium.compat.activation import activated_env

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="podium run", description=__doc__.split("\n\n")[0],
                                     usage="podium run [--address HOST:PORT] [--num-cpus N] [--num-gpus N] "
                                           "[--native-verl] -- COMMAND...")
    parser.add_argument("--address", default=None,
                        help="scheduler HOST:PORT the first ray.init() joins (else PODIUM_ADDRESS, else embedded)")
    parser.add_argument("--num-cpus", type=float, default=None, help="CPUs of the embedded cluster")
    parser.add_argument("--num-gpus", type=int, default=None,
                        help="GPUs of the embedded cluster (fake ones where NVML finds none)")
    parser.add_argument("--native-verl", action="store_true",
                        help="verl.single_controller.ray is Podium's own WorkerGroup (the fast path), "
                             "not verl's RayWorkerGroup on the ray stand-in")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program to run, after --")
    return parser


def main(argv: list[str]) -> int:
    """Run ``podium run``; returns COMMAND's exit status (2 for a usage error)."""
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        _parser().print_usage(sys.stderr)
        print("podium run: give the command to run after --, e.g. podium run -- python train.py",
              file=sys.stderr)
        return 2
    env = activated_env(dict(os.environ), address=args.address, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                        native_verl=args.native_verl)
    try:
        return subprocess.call(command, env=env)
    except FileNotFoundError:
        print(f"podium run: command not found: {command[0]}", file=sys.stderr)
        return 127
    except KeyboardInterrupt:
        return 130
