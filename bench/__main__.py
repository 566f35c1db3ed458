"""Podium vs verl on Ray, side by side: ``python -m bench``.

    python -m bench [--n 1 2 4 8] [--payload-mib 1 16 128] [--backends podium ray]
                    [--repeat K] [--json PATH] [--quick] [--ray-python PATH]

Then the cross-host section (:mod:`bench.crosshost`): DP_COMPUTE_PROTO, one-way and
worker-to-worker transfers with shared memory, over TCP only (what a worker on another
host gets), over TCP with TLS, and on Ray with one raylet and across two.

This parent process measures nothing itself: for each N and backend it runs one child
(``python -m bench.podium_side`` / ``bench.ray_side``) with a deadline, so Ray and Podium
never share a process and a backend that hangs or crashes costs its own cells only. It then
prints one table per measure with both backends and the ratio Podium/Ray, the cold-start
breakdown, and one JSON line per cell (also written to ``--json PATH``).

A backend runs only if it imports in its interpreter (Podium always; Ray when ``ray`` and
``verl`` import). ``--ray-python`` names the interpreter of a separate environment
that has them (see bench/README.md).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

from bench import report
from bench.children import run_child, usable_backends


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", help="workers per group (default 1 2 4 8)")
    parser.add_argument("--payload-mib", type=int, nargs="+", help="DP_COMPUTE_PROTO payloads (default 1 16 128)")
    parser.add_argument("--backends", nargs="+", choices=report.BACKENDS, default=["podium", "ray"])
    parser.add_argument("--repeat", type=int, help="timed DP_COMPUTE_PROTO round trips per payload (default 5)")
    parser.add_argument("--cold-repeat", type=int, default=1, help="fresh groups timed per N (median)")
    parser.add_argument("--latency-calls", type=int, help="no-op calls timed per N (default 500)")
    parser.add_argument("--nonblocking-calls", type=int, help="blocking=False calls per N (default 1000)")
    parser.add_argument("--step-timeout", type=float, default=120.0, help="deadline of one step, seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON lines here")
    parser.add_argument("--quick", action="store_true",
                        help="N 1 2, payloads 1 16 MiB, fewer calls: a smoke run of a minute or two")
    parser.add_argument("--ray-python", default=os.environ.get("BENCH_RAY_PYTHON", sys.executable),
                        help="interpreter for the Ray child (default: this one, or $BENCH_RAY_PYTHON)")
    parser.add_argument("--from-json", metavar="PATH",
                        help="measure nothing: print the tables of a run saved with --json")
    parser.add_argument("--podium-python", default=sys.executable, help="interpreter for the Podium child")
    parser.add_argument("--no-crosshost", action="store_true",
                        help="skip the cross-host section (bench.crosshost: TCP without shared memory, "
                             "TLS, Ray across two raylets)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.n = args.n or ([1, 2] if quick else [1, 2, 4, 8])
    args.payload_mib = args.payload_mib or ([1, 16] if quick else [1, 16, 128])
    args.repeat = args.repeat or (2 if quick else 5)
    args.latency_calls = args.latency_calls or (100 if quick else 500)
    args.nonblocking_calls = args.nonblocking_calls or (200 if quick else 1000)
    if quick:
        args.step_timeout = min(args.step_timeout, 60.0)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every (N, backend) child, then print the tables and the JSON lines."""
    args = parse_args(argv)
    if args.from_json:
        cells = report.cells_from_json_lines(pathlib.Path(args.from_json).read_text().splitlines())
        print(report.tables(report.pair_cells(cells), {c["backend"] for c in cells}))
        print(report.breakdown_table(cells))
        return 0
    cells: list[dict] = []
    backends = usable_backends(args)
    if not backends:
        print("nothing to measure: no backend imports (see above; bench/README.md says how to "
              "install the Ray side)")
        return 2
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    meta: dict[str, dict] = {}
    for n in args.n:
        for backend in backends:
            print(f"[{time.monotonic() - started:6.1f}s] {backend} N={n}", file=sys.stderr, flush=True)
            for cell in run_child(args, backend, n):
                if cell.get("measure") == "meta":
                    meta[backend] = cell.get("versions", {})
                else:
                    cells.append(cell)
    paired = report.pair_cells(cells)
    versions = "; ".join(" ".join(f"{k} {v}" for k, v in meta[b].items()) for b in meta)
    # The machine may be shared: the load average says how much the numbers can be trusted.
    print(f"# Podium vs verl on Ray ({versions}; {os.cpu_count()} CPUs; "
          f"{time.monotonic() - started:.0f} s; 1-min load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after)\n")
    print(report.tables(paired, backends))
    print(report.breakdown_table(cells))
    lines = report.json_lines(paired)
    print("\n".join(lines))
    if args.json:
        pathlib.Path(args.json).write_text("\n".join(lines) + "\n")
    if not args.no_crosshost:  # same host beside cross-host, with Ray across two raylets
        from bench import crosshost

        print()
        modes = [m for m in crosshost.MODES if crosshost.MODES[m][0] in backends]
        crosshost.main(["--n", *map(str, args.n), "--payload-mib", *map(str, args.payload_mib),
                        "--repeat", str(min(args.repeat, 3)), "--ray-python", args.ray_python,
                        "--step-timeout", str(args.step_timeout), "--modes", *modes]
                       + ([] if args.quick else ["--gib"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
