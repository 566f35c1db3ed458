"""What recording the timeline costs (``podium.timeline``): a no-op ``ONE_TO_ALL`` call on
N=8 ranks and a 16 MiB ``DP_COMPUTE_PROTO`` round trip (N=2), with recording on and off
(``PODIUM_TIMELINE=0``) side by side in one run.

    python -m bench.timeline_cost [--repeat 300] [--big-repeat 15]

Each cell is a median after warm-up calls. Recording off and on are measured in alternating
rounds (off, on, off, on), each in a fresh process with its own cluster (a second cluster in
one process runs slower than the first, which would bias whichever comes second), so drift
of the machine falls on both. The goal: at most 5% on the no-op call and 1% on the 16 MiB
round trip.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def _median_us(fn, repeat: int) -> float:
    for _ in range(max(3, repeat // 10)):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def _cells(repeat: int, big_repeat: int, record: bool) -> tuple[float, float]:
    import podium
    from podium import DataProto
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.tracering import RING
    from podium.worker import Dispatch, Worker, register

    class Bench(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def noop(self):
            return None

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def same(self, data):
            return data

    os.environ["PODIUM_TIMELINE"] = "1" if record else "0"  # the workers read it at start
    RING.on = record
    podium.init(num_cpus=10, log_to_driver=False)
    try:
        wide = WorkerGroup(ResourcePool([8], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Bench))
        noop = _median_us(wide.noop, repeat)
        wide.shutdown()
        pair = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Bench))
        batch = DataProto.from_dict(tensors={"x": torch.ones(16 * 1024, 256)})  # 16 MiB
        big = _median_us(lambda: pair.same(batch), big_repeat)
        pair.shutdown()
    finally:
        podium.shutdown()
    return noop, big


def main(argv: list[str] | None = None) -> int:
    """Print each cell with recording off and on, and their ratio."""
    parser = argparse.ArgumentParser(prog="python -m bench.timeline_cost")
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--big-repeat", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cell", choices=("on", "off"), help=argparse.SUPPRESS)  # one round, in this process
    args = parser.parse_args(argv)
    if args.cell:
        print(json.dumps(_cells(args.repeat, args.big_repeat, args.cell == "on")))
        return 0
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for record in (False, True):
            out = subprocess.run([sys.executable, "-m", "bench.timeline_cost", "--cell", "on" if record else "off",
                                  "--repeat", str(args.repeat), "--big-repeat", str(args.big_repeat)],
                                 capture_output=True, text=True, check=True, timeout=600).stdout
            results[record].append(tuple(json.loads(out.strip().splitlines()[-1])))
    off = [statistics.median(c[i] for c in results[False]) for i in range(2)]
    on = [statistics.median(c[i] for c in results[True]) for i in range(2)]
    for record in (False, True):
        rounds = ", ".join(f"{a:.0f} us / {b / 1000:.1f} ms" for a, b in results[record])
        print(f"  rounds with recording {'on ' if record else 'off'}: {rounds}")
    print("timeline recording: off / on / on÷off (median of rounds)")
    print(f"  no-op ONE_TO_ALL, N=8        {off[0]:8.0f} us {on[0]:8.0f} us  {on[0] / off[0]:5.3f}x")
    print(f"  16 MiB DP_COMPUTE_PROTO, N=2 {off[1] / 1000:8.1f} ms {on[1] / 1000:8.1f} ms  {on[1] / off[1]:5.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
