"""How long the live stacks of a whole group take: ``python -m bench.stacks_bench [--n 128]``.

One embedded cluster, one group of N CPU workers. Measured, each ``--repeat`` times:

* ``podium.stacks(group=wg)`` with every rank idle, and with every rank inside a method
  (``time.sleep`` in the execution thread; the stacks come from each worker's event loop);
* the ``podium stack --group ...`` command end to end (a fresh interpreter: imports, the
  scheduler's ClusterState, N worker asks and one agent ask, printing), while every rank is busy.

The issue's goal is <= 1 s for N=128 while every rank is inside a method. It prints one JSON
line with the medians and maxima (seconds). Run it under the machine's bench lock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import podium
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.worker import Dispatch, Worker, register


class Napper(Worker):
    """Naps in its execution thread for as long as asked."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def nap(self, seconds):
        time.sleep(seconds)
        return self.rank


def _timed(fn, repeat: int) -> tuple[list[float], object]:
    times, last = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - started)
    return times, last


def _summary(times: list[float]) -> dict:
    return {"median_s": round(statistics.median(times), 4), "max_s": round(max(times), 4), "runs": len(times)}


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m bench.stacks_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=128, help="workers in the group (128)")
    parser.add_argument("--repeat", type=int, default=5, help="collections per measure (5)")
    args = parser.parse_args(argv)
    rt = podium.init(num_cpus=args.n, log_to_driver=False)
    out: dict = {"bench": "stacks", "n": args.n}
    try:
        started = time.perf_counter()
        wg = WorkerGroup(ResourcePool([args.n], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Napper),
                         name_prefix="stacksbench_", device_name="cpu")
        out["group_start_s"] = round(time.perf_counter() - started, 2)
        idle, report = _timed(lambda: podium.stacks(group=wg), args.repeat)
        assert len(report) == args.n and all(r.answered for r in report), str(report)[:2000]  # type: ignore[arg-type]
        out["idle"] = _summary(idle)
        refs = wg.nap(120)
        deadline = time.monotonic() + 120
        while True:  # until every rank is inside nap()
            report = podium.stacks(group=wg)
            inside = sum(any("in nap" in t.stack for t in r.threads) for r in report)
            if inside == args.n:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"only {inside}/{args.n} ranks were inside nap() after 120 s")
            time.sleep(0.2)
        busy, report = _timed(lambda: podium.stacks(group=wg), args.repeat)
        out["busy"] = _summary(busy)
        out["busy_all_answered"] = all(r.answered for r in report)  # type: ignore[attr-defined]
        env = dict(os.environ, PODIUM_TOKEN=rt.token)
        env.pop("PODIUM_TOKEN_FILE", None)
        command = [sys.executable, "-m", "podium.cli", "stack", "--address", rt.address, "--group", "stacksbench_"]

        def cli() -> int:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
            if done.returncode != 0 or done.stdout.count("=== group stacksbench_") != args.n:
                raise SystemExit(f"podium stack failed: {done.returncode} {done.stderr[-2000:]}")
            return len(done.stdout)

        cli_times, printed = _timed(cli, args.repeat)
        out["cli_busy"] = _summary(cli_times)
        out["cli_bytes"] = printed
        del refs
    finally:
        podium.shutdown()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
