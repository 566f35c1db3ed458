"""What non-blocking arguments as snapshots cost: a 128 MiB ``DP_COMPUTE_PROTO`` round trip
with ``blocking=False`` (held in the worker, then ``get``), with the snapshot taken as the call
returns against the same call with the snapshot step switched off (here only: the arguments
are then read from the caller's tensors when they are sent, as before snapshots), on one host
(shared memory) and over TCP; the blocking round trip, the machine's memcpy and how long the
non-blocking call took to return beside them (over TCP the arguments are sent before the call
returns, copied only where the send falls behind: :mod:`podium.transport.copyonsend`).

    python -m bench.snapshot_cost [--mib 128] [--repeat 15]

Each cell is the median of ``--repeat`` round trips after two warm-up ones, the two variants
alternating call by call so that drift hits both alike. The goal is a snapshot cost of at most
10% of the non-blocking round trip.
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


def _alternating_ms(first, second, repeat: int) -> tuple[float, float]:
    """Medians of ``first`` and ``second`` run in turn, ``repeat`` times each."""
    for _ in range(2):
        first()
        second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for fn, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[0]), 1000 * statistics.median(times[1])


def main(argv: list[str] | None = None) -> int:
    """Print one line per path: blocking, non-blocking without and with the snapshot, its cost."""
    parser = argparse.ArgumentParser(prog="python -m bench.snapshot_cost")
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args(argv)

    import podium
    from podium import DataProto
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.controller.group.calls import GroupCaller
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
    taken = GroupCaller._snapshot

    returned: list[float] = []  # how long the call took to return, with the snapshot

    def later(snapshot: bool):
        def run():
            GroupCaller._snapshot = taken if snapshot else (lambda self, ranks, payload: payload)
            try:
                start = time.perf_counter()
                future = wg.later(batch)
                if snapshot:
                    returned.append(time.perf_counter() - start)
                future.get()
            finally:
                GroupCaller._snapshot = taken
        return run

    print(f"{args.mib} MiB round trip, N=1 (memcpy {memcpy:.1f} ms): blocking; blocking=False without / "
          "with the snapshot; its cost; when the call returned, with the snapshot")
    # A threshold no payload reaches keeps same-host calls on TCP (the workers read it too).
    for label, threshold in (("one host (shared memory)", ""), ("TCP", str(1 << 60))):
        os.environ["PODIUM_SHM_THRESHOLD_BYTES"] = threshold
        podium.init(num_cpus=2)
        try:
            wg = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Echo))
            blocking = _median_ms(lambda: wg.same(batch), args.repeat)
            returned.clear()
            off, on = _alternating_ms(later(False), later(True), args.repeat)
            back = 1000 * statistics.median(returned)
            print(f"  {label:26s} {blocking:7.1f} ms   {off:7.1f} ms  {on:7.1f} ms   {100 * (on / off - 1):+5.1f}%"
                  f"   {back:6.1f} ms")
            wg.shutdown()
        finally:
            podium.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
