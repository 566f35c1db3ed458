"""What recording the timeline costs (``podium.timeline``): a no-op ``ONE_TO_ALL`` call on
N=8 ranks and a 16 MiB ``DP_COMPUTE_PROTO`` round trip (N=2), with recording on and off
side by side in one run.

    python -m bench.timeline_cost [--blocks 20] [--calls 100] [--big-calls 10]

Recording is switched in every process of one cluster at once (the controller's ring and,
through a method of the benchmark's worker class, each worker's), in alternating blocks of
calls (off then on, on then off, ...): the machine's drift, which between two clusters is larger
than the cost measured (tens of percent on 2 cores), falls on both. Each block's cell is the
median of its calls; the result is the median over blocks of on÷off. The goal: at most 5% on
the no-op call and 1% on the 16 MiB round trip.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Print both cells with recording off and on, and their ratio."""
    parser = argparse.ArgumentParser(prog="python -m bench.timeline_cost")
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--calls", type=int, default=100, help="no-op calls per block")
    parser.add_argument("--big-calls", type=int, default=10, help="16 MiB round trips per block")
    args = parser.parse_args(argv)

    import podium
    from podium import DataProto
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.tracering import RING
    from podium.worker import Dispatch, Worker, register

    class Bench(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def record(self, on: bool) -> None:
            from podium.tracering import RING
            RING.on = on

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def noop(self):
            return None

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def same(self, data):
            return data

    podium.init(num_cpus=10, log_to_driver=False)
    try:
        wide = WorkerGroup(ResourcePool([8], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Bench))
        pair = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Bench))
        batch = DataProto.from_dict(tensors={"x": torch.ones(16 * 1024, 256)})  # 16 MiB
        cells = {"noop": (lambda: wide.noop(), args.calls), "big": (lambda: pair.same(batch), args.big_calls)}
        ratios: dict[str, list[float]] = {name: [] for name in cells}
        medians: dict[tuple[str, bool], list[float]] = {(name, on): [] for name in cells for on in (False, True)}
        for fn, calls in cells.values():  # warm-up
            _median_us(fn, max(3, calls // 5))
        for i in range(args.blocks):
            block = {}
            for on in ((False, True) if i % 2 == 0 else (True, False)):  # neither always goes first
                RING.on = on
                wide.record(on)
                pair.record(on)
                for name, (fn, calls) in cells.items():
                    block[name, on] = _median_us(fn, calls)
                    medians[name, on].append(block[name, on])
            for name in cells:
                ratios[name].append(block[name, True] / block[name, False])
        wide.shutdown()
        pair.shutdown()
    finally:
        podium.shutdown()
    print(f"timeline recording: off / on (medians over {args.blocks} blocks), on÷off (median of blocks)")
    for name, label, scale, unit in (("noop", "no-op ONE_TO_ALL, N=8", 1, "us"),
                                     ("big", "16 MiB DP_COMPUTE_PROTO, N=2", 1000, "ms")):
        off = statistics.median(medians[name, False]) / scale
        on = statistics.median(medians[name, True]) / scale
        print(f"  {label:30s} {off:8.1f} {unit} {on:8.1f} {unit}  {statistics.median(ratios[name]):5.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
