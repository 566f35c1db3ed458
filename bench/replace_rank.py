"""Rank replacement (issue 51): seconds from a rank's death to the group serving its next call
with a new rank, split into detection, fence, handover and rendezvous, with a warm standby and
without one (a fresh worker), at each N asked for.

    python -m bench.replace_rank [--n 8 64] [--repeat 2] [--no-gloo]

One embedded cluster; per N and mode a group of N CPU workers that formed a gloo group; in a
blocking all-reduce call one rank is SIGKILLed. ``detection``: the kill to that call's
``WorkerDiedError``. The next call (``on_rank_death="replace"``) replaces the rank (``fence``:
the old process killed and reaped; ``handover``: a standby takes the rank, or a fresh worker
is started and its class constructed; ``rendezvous``: a new MASTER_PORT and every rank's
``@on_rendezvous`` hook re-forming gloo) and then all-reduces: ``serving`` is that whole call.
``in hooks``: the longest time one rank spent in its hook (gloo's destroy and init); the rest
of ``rendezvous`` is the wait for every rank to be free for the hook (a survivor's failed
all-reduce ends first). ``first form``, for scale: the group's first gloo formation.
``--no-gloo``: no torch.distributed anywhere (the hook only notes the version, the calls only
sleep): Podium's own part, for an N whose gloo mesh a small machine cannot form in time.
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
    parser.add_argument("--n", type=int, nargs="+", default=[8], help="group sizes (2..128 each)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per N and mode (1..20)")
    parser.add_argument("--no-gloo", dest="gloo", action="store_false",
                        help="no torch.distributed: the hook notes the version, the calls only sleep")
    args = parser.parse_args(argv)
    if not all(2 <= n <= 128 for n in args.n) or not 1 <= args.repeat <= 20:
        parser.error("need --n in 2..128 and --repeat in 1..20")

    import podium
    from podium.worker import Dispatch, Rendezvous, Worker, on_rendezvous, register

    gloo = args.gloo

    class Ranked(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def form(self):
            if not gloo:
                return self.rank
            import torch.distributed as dist
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
            return self.rank

        @on_rendezvous
        def reform(self, rdzv: Rendezvous):
            self.version = rdzv.version
            if not gloo:
                return
            import torch.distributed as dist
            started = time.monotonic()
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
            self.hook_s = time.monotonic() - started

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def hook_seconds(self):
            return getattr(self, "hook_s", 0.0)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def allreduce(self, stall_rank=-1):
            if self.rank == stall_rank:
                time.sleep(600)
            if not gloo:  # the world size, as the all-reduce of ones would give it
                return float(self.world_size)
            import torch
            import torch.distributed as dist
            t = torch.ones(1)
            try:
                dist.all_reduce(t)
            except Exception:
                # Close this rank's connections, so the ranks still waiting on it fail now
                # too instead of at the group's timeout (gloo has no abort).
                dist.destroy_process_group()
                raise
            return t.item()

    podium.init(num_cpus=4 * (max(args.n) + 1), log_to_driver=False)
    try:
        print(f"N={args.n}, {os.cpu_count()} cores, gloo {'on' if gloo else 'off'}", flush=True)
        for n in args.n:
            rows: dict[str, list[dict[str, float]]] = {"standby": [], "fresh": []}
            for i in range(args.repeat):
                for mode in rows:
                    rows[mode].append(_one_run(Ranked, n, mode))
                    print(f"  N={n} run {i + 1} {mode:7s}: "
                          + ", ".join(f"{k} {v:.2f} s" for k, v in rows[mode][-1].items()), flush=True)
            for mode, runs in rows.items():
                keys = list(runs[0])
                print(f"  N={n} median {mode:7s}: "
                      + ", ".join(f"{k} {statistics.median(r[k] for r in runs):.2f} s" for k in keys), flush=True)
    finally:
        podium.shutdown()
    return 0


def _one_run(ranked: type, n: int, mode: str) -> dict[str, float]:
    """One group of ``n`` ``ranked`` workers: form, kill the last rank in an all-reduce, time
    the replacement."""
    from podium import errors
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    wg = WorkerGroup(ResourcePool([n], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(ranked),
                     standby=1 if mode == "standby" else 0, on_rank_death="replace")
    try:
        formed = time.monotonic()
        wg.form()
        formed = time.monotonic() - formed  # the first gloo group of n ranks, for scale
        victim = n - 1
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
        assert wg.allreduce() == [float(n)] * n
        served = time.monotonic()
        return {"detection": detected - killed[0], **wg.last_replacement,
                "serving": served - detected, "total": served - killed[0], "first form": formed,
                "in hooks": max(wg.hook_seconds())}
    finally:
        wg.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
