"""Rank replacement (issue 51): seconds from a rank's death to the group serving its next call
with a new rank, split into detection, fence, handover and rendezvous, with a warm standby and
without one (a fresh worker).

    python -m bench.replace_rank [--n 8] [--repeat 2]

One embedded cluster; a group of N CPU workers that formed a gloo group; in a blocking
all-reduce call one rank is SIGKILLed. ``detection``: the kill to that call's
``WorkerDiedError``. The next call (``on_rank_death="replace"``) replaces the rank (``fence``:
the old process killed and reaped; ``handover``: a standby takes the rank, or a fresh worker
is started and its class constructed; ``rendezvous``: a new MASTER_PORT and every rank's
``@on_rendezvous`` hook re-forming gloo) and then all-reduces: ``serving`` is that whole call.
Podium only: Ray restarts an actor but leaves the rank and the collective group to the user.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import statistics
import threading
import time


def main(argv: list[str] | None = None) -> int:
    """Print one line per run and the medians per mode."""
    parser = argparse.ArgumentParser(prog="python -m bench.replace_rank")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    if args.n < 2 or args.repeat < 1:
        parser.error("need --n >= 2 and --repeat >= 1")

    import podium
    from podium import errors
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.worker import Dispatch, Rendezvous, Worker, on_rendezvous, register

    class Ranked(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def form(self):
            import torch.distributed as dist
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
            return self.rank

        @on_rendezvous
        def reform(self, rdzv: Rendezvous):
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def allreduce(self, stall_rank=-1):
            import torch
            import torch.distributed as dist
            if self.rank == stall_rank:
                time.sleep(600)
            t = torch.ones(1)
            try:
                dist.all_reduce(t)
            except Exception:
                # Close this rank's connections, so the ranks still waiting on it fail now
                # too instead of at the group's timeout (gloo has no abort).
                dist.destroy_process_group()
                raise
            return t.item()

    podium.init(num_cpus=4 * (args.n + 1), log_to_driver=False)
    rows: dict[str, list[dict[str, float]]] = {"standby": [], "fresh": []}
    try:
        print(f"N={args.n}, {os.cpu_count()} cores")
        for i in range(args.repeat):
            for mode in rows:
                wg = WorkerGroup(ResourcePool([args.n], use_gpu=False, max_colocate_count=1),
                                 ClassWithInitArgs(Ranked), standby=1 if mode == "standby" else 0,
                                 on_rank_death="replace")
                try:
                    wg.form()
                    victim = args.n - 1
                    pid = wg.workers[victim].pid
                    killed = [0.0]

                    def strike() -> None:
                        time.sleep(0.5)
                        killed[0] = time.monotonic()
                        os.kill(pid, signal.SIGKILL)

                    threading.Thread(target=strike, daemon=True).start()
                    try:
                        wg.allreduce(stall_rank=victim)
                        raise AssertionError("the call outlived its rank")
                    except errors.WorkerDiedError:
                        detected = time.monotonic()
                    assert wg.allreduce() == [float(args.n)] * args.n
                    served = time.monotonic()
                    row = {"detection": detected - killed[0], **{k: v for k, v in wg.last_replacement.items()},
                           "serving": served - detected, "total": served - killed[0]}
                    rows[mode].append(row)
                    print(f"  run {i + 1} {mode:7s}: " + ", ".join(f"{k} {v:.2f} s" for k, v in row.items()),
                          flush=True)
                finally:
                    wg.shutdown()
        for mode, runs in rows.items():
            keys = list(runs[0])
            print(f"  median {mode:7s}: " + ", ".join(f"{k} {statistics.median(r[k] for r in runs):.2f} s"
                                                     for k in keys))
    finally:
        podium.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
