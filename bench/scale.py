"""Podium vs verl on Ray at hundreds of workers: ``python -m bench.scale``.

    python -m bench.scale [--n 8 16 32 64 128 256] [--backends podium ray]
                          [--ray-python PATH] [--ray-minutes 10] [--json PATH] [--floor wire]

One group of N CPU workers on one embedded cluster per (backend, N), in a child process
of its own (the same children as ``python -m bench``, see bench.measure), measuring:

* cold start of a plain worker and of one whose ``__init__`` imports torch, with the phase
  breakdown (spawn requested, forked, serving, constructed, first call);
* no-op ONE_TO_ALL latency, and the CPU time of the controller and of all workers per call;
* DP_COMPUTE_PROTO round trip of a 16 MiB batch;
* memory per worker (PSS after the DP step, so torch and a batch have been through it);
* non-blocking calls per second, and the same as rank-calls per second (pipelined).

Before the backends at each N it measures the machine's floor of the no-op
(``bench.floors.fanout``: N bare processes answering Podium's frames, ``--floor wire`` by
default): its latency, and the CPU of its sender and of its N processes, per call and per
rank. Each table shows Podium's value over the floor of the same run beside the one over Ray.

A backend's larger N are skipped once one N of it failed, took longer than
``--ray-minutes`` (Ray), or would need more memory than the machine has (memory per worker
at the last N times the next N, with a margin): the reason is printed with the tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench import report
from bench.floors import FANOUT_KINDS, fanout
from bench.children import expected_keys, run_child, usable_backends

#: The sizes the issue asks for; 256 fits Podium on a 24 GiB machine (about 15 MiB each).
DEFAULT_N = [8, 16, 32, 64, 128, 256]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=DEFAULT_N, help="workers per group")
    parser.add_argument("--backends", nargs="+", choices=report.BACKENDS, default=["podium", "ray"])
    parser.add_argument("--payload-mib", type=int, nargs="+", default=[16])
    parser.add_argument("--ray-python", default=os.environ.get("BENCH_RAY_PYTHON", sys.executable),
                        help="interpreter for the Ray child (default: this one, or $BENCH_RAY_PYTHON)")
    parser.add_argument("--podium-python", default=sys.executable)
    parser.add_argument("--ray-minutes", type=float, default=10.0,
                        help="a Ray N that takes longer than this ends Ray's run (larger N skipped)")
    parser.add_argument("--step-timeout", type=float, default=300.0, help="deadline of one step, seconds")
    parser.add_argument("--latency-calls", type=int, default=200)
    parser.add_argument("--json", metavar="PATH", help="also write the JSON lines here")
    parser.add_argument("--floor", choices=[*FANOUT_KINDS, "none"], default="wire",
                        help="which no-op floor (bench.floors.fanout) to measure at each N")
    args = parser.parse_args(argv)
    # What bench.children.run_child passes on to every child.
    args.repeat, args.cold_repeat, args.nonblocking_calls = 3, 1, 200
    return args


def main(argv: list[str] | None = None) -> int:
    """Run each backend at each N (largest last), then print the tables and JSON lines."""
    args = parse_args(argv)
    backends = usable_backends(args)
    if not backends:
        print("nothing to measure: no backend imports")
        return 2
    started = time.monotonic()
    cells: list[dict] = []
    stopped: dict[str, str] = {}
    per_worker_mib: dict[str, float] = {}  # memory per worker at the last N measured
    for n in sorted(args.n):
        for backend in backends:
            if backend not in stopped and backend in per_worker_mib:
                need = per_worker_mib[backend] * n * 1.25 / 1024
                free = _available_gib()
                if need > free * 0.8:
                    stopped[backend] = (f"N={n} would need about {need:.1f} GiB for its workers "
                                        f"(PSS at the last N), the machine has {free:.1f} GiB available")
            if backend in stopped:
                cells += [{"backend": backend, "measure": measure, "n": n, "payload_mib": mib,
                           "error": f"skipped: {stopped[backend]}"} for measure, _, mib in _keys(args, n)]
                continue
            if args.floor != "none" and not any(c["backend"] == report.FLOOR and c["n"] == n for c in cells):
                print(f"[{time.monotonic() - started:6.1f}s] floor ({args.floor}) N={n}", file=sys.stderr, flush=True)
                cells += floor_cells(n, args.floor)
            print(f"[{time.monotonic() - started:6.1f}s] {backend} N={n}", file=sys.stderr, flush=True)
            began = time.monotonic()
            got = [c for c in run_child(args, backend, n) if c.get("measure") != "meta"]
            cells += got
            took = time.monotonic() - began
            for cell in got:
                if cell.get("measure") == "worker_pss_mib" and not cell.get("error"):
                    per_worker_mib[backend] = cell["value"]
            failed = [c for c in got if c.get("error")]
            if failed:
                stopped[backend] = f"N={n} failed ({failed[0]['measure']}: {failed[0]['error'][:120]})"
            elif backend == "ray" and took > args.ray_minutes * 60:
                stopped[backend] = f"N={n} took {took / 60:.1f} min (more than --ray-minutes {args.ray_minutes:g})"
    paired = report.pair_cells(cells)
    print(f"# Scale: Podium vs verl on Ray ({os.cpu_count()} CPUs; {time.monotonic() - started:.0f} s; "
          f"1-min load average {os.getloadavg()[0]:.1f} at the end)\n")
    print(report.tables(paired, backends))
    for backend, reason in stopped.items():
        print(f"{backend} stopped: {reason}\n")
    print(report.breakdown_table(cells))
    lines = report.json_lines(paired)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as out:
            out.write("\n".join(lines) + "\n")
    return 0


def floor_cells(n: int, kind: str) -> list[dict]:
    """The no-op floor at ``n`` ranks as cells of the backend ``floor`` (error cells when it
    could not run, e.g. too many processes for the machine)."""
    measures = {"noop_latency_median_ms": ("median_ms", 1.0), "noop_latency_p90_ms": ("p90_ms", 1.0),
                "noop_controller_cpu_ms": ("sender_us_per_rank", n / 1e3),
                "noop_workers_cpu_ms": ("ranks_us_per_rank", n / 1e3),
                "noop_controller_us_per_rank": ("sender_us_per_rank", 1.0),
                "noop_workers_us_per_rank": ("ranks_us_per_rank", 1.0)}
    base = {"backend": report.FLOOR, "n": n, "kind": kind}
    try:
        measured = fanout(n, kind=kind)
    except Exception as exc:  # noqa: BLE001 - reported beside the cells, the run goes on
        return [{**base, "measure": m, "error": f"{type(exc).__name__}: {exc}"} for m in measures]
    return [{**base, "measure": m, "value": measured[key] * scale} for m, (key, scale) in measures.items()]


def _available_gib() -> float:
    """MemAvailable from /proc/meminfo, GiB (inf where it cannot be read)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1 << 20)
    except (OSError, ValueError):
        pass
    return float("inf")


def _keys(args: argparse.Namespace, n: int) -> list[tuple]:
    return sorted(expected_keys(args, n), key=lambda k: (k[0], k[2] or 0))


if __name__ == "__main__":
    sys.exit(main())
