"""Weight broadcast: a trainer rank's weights to N replica processes, Podium beside Ray,
against the loopback TCP floor measured in the same run.

    python -m bench.broadcast [--mib 64 512] [--replicas 1 2 4 8] [--repeat 3] [--max-gib 8]
                              [--modes "podium cross-host" "podium same-host" "ray put" ...]
                              [--ray-python PATH] [--json PATH]

Each mode runs in a child process of its own (its cluster and environment apart):

- ``podium cross-host``: :func:`podium.rollout.broadcastgroups.broadcast_weights` along the
  chain with ``PODIUM_DISABLE_SHM=1``: every link a TCP stream, as between hosts;
- ``podium same-host``: the same where the processes share ``/dev/shm``: the buckets go as
  segments the trainer writes once and every replica maps (:mod:`podium.rollout.broadcastshm`);
- ``ray put``, ``ray put-two-nodes``, ``ray collective``: :mod:`bench.broadcast_ray` (``ray.put``
  plus N gets on one node, the same across two raylets, ``ray.util.collective`` broadcast over
  gloo), run with ``--ray-python``.

A trainer holds ``--mib`` MiB of float32 in 32 MiB tensors, each replica the same shapes;
a cell is the median wall time of one update (start to every replica's tensors loaded, after
a warm-up). The floor, measured before the modes and after: one loopback TCP stream
(:mod:`bench.floors`, uvloop, median of 3). A chain to N replicas over TCP moves N streams'
worth of bytes (each replica receives once; the sender and N - 1 replicas send once); a
stream takes about both cores here (sender and receiver), so N of them take N times one:
the table's "N streams" column is N x the size at the measured floor. Cells whose replicas
would hold more than ``--max-gib`` GiB in all are skipped. Not a test: nothing here asserts
a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.broadcast_ray import shapes

MODES = ["podium cross-host", "podium same-host", "ray put", "ray put-two-nodes", "ray collective"]
MARK = "BCAST "


def podium_child(mibs: list[int], replicas: list[int], repeat: int, max_gib: float, bucket_mib: int) -> None:
    """Measure every (size, replicas) cell of one Podium mode; prints BCAST lines."""
    import torch

    import podium
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.rollout.broadcastgroups import BroadcastSource, BroadcastTarget, broadcast_weights
    from podium.worker import Dispatch, Worker, register

    class Holder(Worker):
        """Holds ``mib`` MiB of float32 weights, all ``fill``."""

        fill = 0.0

        def __init__(self):
            super().__init__()
            self.state: dict = {}

        def rollout_state_dict(self):
            return self.state

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def build(self, mib: int) -> None:
            self.state = {k: torch.full(s, self.fill) for k, s in shapes(mib).items()}
            self._podium_receiver = None  # a new layout: new staging buffers

    class Trainer(BroadcastSource, Holder):
        fill = 1.5

    class Replica(BroadcastTarget, Holder):
        pass

    mode = "podium cross-host" if os.environ.get("PODIUM_DISABLE_SHM") else "podium same-host"
    podium.init(num_cpus=max(replicas) + 2)
    try:
        trainer = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Trainer),
                              name_prefix="bench-trainer")
        for mib in mibs:
            trainer.build(mib)
            for n in replicas:
                if n * 2 * mib / 1024 > max_gib:
                    continue
                group = WorkerGroup(ResourcePool([n], use_gpu=False, max_colocate_count=1),
                                    ClassWithInitArgs(Replica), name_prefix=f"bench-replicas{n}")
                try:
                    group.build(mib)
                    broadcast_weights(trainer, group, step=0, bucket_bytes=bucket_mib << 20)  # warm-up
                    times = []
                    for step in range(1, repeat + 1):
                        start = time.perf_counter()
                        broadcast_weights(trainer, group, step=step, bucket_bytes=bucket_mib << 20)
                        times.append(time.perf_counter() - start)
                finally:
                    group.shutdown()
                seconds = statistics.median(times)
                print(MARK + json.dumps({"backend": mode, "mib": mib, "replicas": n, "seconds": seconds,
                                         "all": times, "mb_s": (mib << 20) / 1e6 / seconds}), flush=True)
        trainer.shutdown()
    finally:
        podium.shutdown()


def _run_mode(mode: str, args: argparse.Namespace) -> list[dict]:
    """Every cell of ``mode``, each from its child's BCAST lines (a failed cell is reported)."""
    cells: list[dict] = []
    if mode.startswith("podium"):
        env = dict(os.environ)
        env.pop("PODIUM_DISABLE_SHM", None)
        if mode == "podium cross-host":
            env["PODIUM_DISABLE_SHM"] = "1"
        commands = [([sys.executable, "-m", "bench.broadcast", "--child", *map(str, ["--mib", *args.mib]),
                      *map(str, ["--replicas", *args.replicas]), "--repeat", str(args.repeat),
                      "--max-gib", str(args.max_gib), "--bucket-mib", str(args.bucket_mib)], env)]
    else:
        kind = mode.removeprefix("ray ")
        commands = [([args.ray_python, "-m", "bench.broadcast_ray", "--mode", kind, "--mib", str(mib),
                      "--replicas", str(n), "--repeat", str(args.repeat)], dict(os.environ))
                    for mib in args.mib for n in args.replicas if n * 2 * mib / 1024 <= args.max_gib]
    for argv, env in commands:
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.cell_timeout)
            output = done.stdout
            ok = done.returncode == 0
            tail = (done.stderr or done.stdout)[-600:]
        except subprocess.TimeoutExpired as exc:
            output, ok, tail = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""), \
                False, f"timed out after {args.cell_timeout:g} s"
        found = [json.loads(line[len(MARK):]) for line in output.splitlines() if line.startswith(MARK)]
        cells += found
        for cell in found:
            print(f"{cell['backend']}: {cell['mib']} MiB to {cell['replicas']}: {cell['seconds'] * 1e3:,.0f} ms "
                  f"({cell['mb_s']:,.0f} MB/s per replica)", flush=True)
        if not ok:
            print(f"{mode}: {' '.join(argv[2:])} failed: {tail}", flush=True)
    return cells


def main(argv: list[str] | None = None) -> int:
    """Floors, every mode's cells, floors again; then one table."""
    parser = argparse.ArgumentParser(prog="python -m bench.broadcast")
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-gib", type=float, default=8.0, help="skip cells whose replicas hold more")
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--ray-python", default=os.environ.get("BENCH_RAY_PYTHON", sys.executable))
    parser.add_argument("--cell-timeout", type=float, default=1800.0, help="seconds one child may take")
    parser.add_argument("--json", metavar="PATH", help="also write the cells as JSON lines here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeat < 1 or min(args.mib) < 1 or min(args.replicas) < 1 or args.bucket_mib < 1:
        parser.error("need --repeat, --mib, --replicas and --bucket-mib >= 1")
    if args.child:
        podium_child(args.mib, args.replicas, args.repeat, args.max_gib, args.bucket_mib)
        return 0

    from bench.floors import _stream

    floor_mib = min(512, max(args.mib))
    floors = [_stream(floor_mib << 20, 3, False)]
    print(f"loopback TCP floor ({floor_mib} MiB, one stream, median of 3): {floors[0]:,.0f} MB/s", flush=True)
    cells = [cell for mode in args.modes for cell in _run_mode(mode, args)]
    floors.append(_stream(floor_mib << 20, 3, False))
    floor = statistics.mean(floors)
    streams = {(mib, n): n * (mib << 20) / 1e6 / floor for mib in args.mib for n in args.replicas
               if n * 2 * mib / 1024 <= args.max_gib}
    print(f"\nloopback TCP floor after: {floors[1]:,.0f} MB/s (before {floors[0]:,.0f})\n")
    by = {(c["backend"], c["mib"], c["replicas"]): c for c in cells}
    one = {(c["backend"], c["mib"]): c["seconds"] for c in cells if c["replicas"] == min(args.replicas)}
    print(f"| MiB | replicas | N streams at the floor (ms) | {' | '.join(f'{m} (ms)' for m in args.modes)} | "
          f"podium cross-host / floor | cross-host / {min(args.replicas)} replica | same-host / ray put |")
    print("|" + "---|" * (6 + len(args.modes)))
    for (mib, n), secs in streams.items():
        row = [f"{by[(m, mib, n)]['seconds'] * 1e3:,.0f}" if (m, mib, n) in by else "-" for m in args.modes]
        cross, same, put = (by.get((m, mib, n)) for m in ("podium cross-host", "podium same-host", "ray put"))
        vs_floor = f"{cross['mb_s'] / floor:.2f}x" if cross else "-"
        vs_one = f"{cross['seconds'] / one[('podium cross-host', mib)]:.2f}x" \
            if cross and ("podium cross-host", mib) in one else "-"
        vs_ray = f"{put['seconds'] / same['seconds']:.1f}x faster" if same and put else "-"
        vs_streams = f" ({cross['seconds'] / secs:.2f}x)" if cross else ""
        print(f"| {mib} | {n} | {secs * 1e3:,.0f}{vs_streams} | {' | '.join(row)} | {vs_floor} | {vs_one} | {vs_ray} |")
    if args.json:
        with open(args.json, "w") as out:
            for cell in cells:
                out.write(json.dumps(cell) + "\n")
            out.write(json.dumps({"floor_tcp_mb_s": floors}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
