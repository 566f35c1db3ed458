"""Liveness at scale: how long N busy ranks with some SIGSTOPped take to fail a call, against
the bound (one silence period plus one ping interval).

    python -m bench.liveness_scale [--n 256] [--stopped 8] [--silence 10] [--repeat 3]

One embedded cluster, one group of N CPU workers napping in one blocking ``ONE_TO_ALL`` call
while ``--stopped`` of them are SIGSTOPped (a new random choice each repetition). Each line:
the seconds from the call to its ``UnresponsiveError``, that time over the bound, and whether
the error named exactly the stopped ranks. Podium only: Ray has no counterpart (a stopped
actor's call waits for its timeout).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    """Print one line per repetition and the median."""
    parser = argparse.ArgumentParser(prog="python -m bench.liveness_scale")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--stopped", type=int, default=8)
    parser.add_argument("--silence", type=float, default=10.0, help="the liveness bound (the default's)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if not 0 < args.stopped <= args.n or args.repeat < 1:
        parser.error("need 0 < --stopped <= --n and --repeat >= 1")

    import podium
    from podium import errors
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.controller.session.runtime import get_runtime
    from podium.worker import Dispatch, Worker, register

    class Napper(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def pid(self):
            return os.getpid()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def nap(self, seconds):
            time.sleep(seconds)
            return self.rank

    bound = args.silence + args.silence / 5
    podium.init(num_cpus=args.n, log_to_driver=False)
    times = []
    try:
        get_runtime().deathwatch.liveness.silence = args.silence
        print(f"N={args.n}, {args.stopped} stopped, bound {args.silence:g} s + ping interval "
              f"{args.silence / 5:g} s = {bound:g} s")
        for i in range(args.repeat):
            # A fresh group each time: the ranks found silent are failed for good.
            started = time.monotonic()
            wg = WorkerGroup(ResourcePool([args.n], use_gpu=False, max_colocate_count=1),
                             ClassWithInitArgs(Napper))
            pids = wg.pid()
            ready = time.monotonic() - started
            stopped = sorted(random.Random(i).sample(range(args.n), args.stopped))
            for rank in stopped:
                os.kill(pids[rank], signal.SIGSTOP)
            try:
                started = time.monotonic()
                try:
                    wg.nap(bound + 5)  # outlasts the detection
                    named = []
                except errors.UnresponsiveError as exc:
                    named = sorted(exc.ranks)
                found = time.monotonic() - started
            finally:
                for rank in stopped:
                    os.kill(pids[rank], signal.SIGCONT)
            times.append(found)
            print(f"  run {i + 1} (group ready in {ready:.1f} s): {found:.2f} s = {found / bound:.2f}x the bound; "
                  f"named exactly the stopped ranks: {named == stopped}", flush=True)
            wg.shutdown()
        print(f"  median {statistics.median(times):.2f} s = {statistics.median(times) / bound:.2f}x the bound")
    finally:
        podium.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
