"""What non-blocking arguments as snapshots cost: a 128 MiB ``DP_COMPUTE_PROTO`` round trip,
``blocking=True`` against ``blocking=False`` (whose arguments are copied before the call
returns), on one host (shared memory) and over TCP, with the machine's memcpy beside them.

    python -m bench.snapshot_cost [--mib 128] [--repeat 15]

Each cell is the median of ``--repeat`` round trips after two warm-up ones; the goal is a
non-blocking round trip within 10% of the blocking one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def _median_ms(fn, repeat: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Print one line per path: blocking ms, non-blocking ms, their ratio, memcpy ms."""
    parser = argparse.ArgumentParser(prog="python -m bench.snapshot_cost")
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args(argv)

    import podium
    from podium import DataProto
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.worker import Dispatch, Worker, register

    class Echo(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def same(self, data):
            return data

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def later(self, data):
            return data

    n = args.mib * (1 << 20) // 4
    batch = DataProto.from_dict(tensors={"x": torch.ones(n // 1024, 1024)})
    src, dst = torch.ones(n), torch.empty(n)
    memcpy = _median_ms(lambda: dst.copy_(src), args.repeat)
    print(f"{args.mib} MiB round trip, N=1: blocking / blocking=False (snapshot) / ratio; memcpy {memcpy:.1f} ms")
    # A threshold no payload reaches keeps same-host calls on TCP (the workers read it too).
    for label, threshold in (("one host (shared memory)", ""), ("TCP", str(1 << 60))):
        os.environ["PODIUM_SHM_THRESHOLD_BYTES"] = threshold
        podium.init(num_cpus=2)
        try:
            wg = WorkerGroup(ResourcePool([1], use_gpu=False), ClassWithInitArgs(Echo))
            blocking = _median_ms(lambda: wg.same(batch), args.repeat)
            later = _median_ms(lambda: wg.later(batch).get(), args.repeat)
            print(f"  {label:26s} {blocking:7.1f} ms  {later:7.1f} ms  {later / blocking:5.2f}x")
            wg.shutdown()
        finally:
            podium.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
