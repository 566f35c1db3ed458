"""Issue 17's Ray surface, Podium vs Ray, with the very same program on both sides.

    python -m bench.raysurface [--backends podium ray] [--mib 128] [--readers 8]
                               [--calls 200] [--repeat 3] [--json PATH]

The measuring code is written once against Ray's API; the Podium child imports
``podium.compat.ray as ray``, the Ray child imports ``ray``. Each backend runs in a child
process of its own (a fresh local cluster: ``ray.init(num_cpus=16)`` / Podium's embedded
cluster), one after the other, and prints one ``RAYSURFACE {json}`` line per measure:

* ``put_read``: ``put`` a float32 tensor of ``--mib`` MiB, then ``--readers`` actors each
  read it (a method that takes the ref as its argument and returns its element count);
  seconds of the put, seconds until all readers answered, and aggregate MB/s =
  readers x bytes / read seconds (MB = 10^6 bytes). A fresh put per repetition; median.
* ``task_rtt``: ``get(noop.remote())`` of a task that does nothing, after 20 warm-ups;
  median and p90 over ``--calls`` in microseconds.
* ``actor_rtt``: the same for ``get(actor.noop.remote())``.

Nothing here asserts a time (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MARK = "RAYSURFACE "


def _child(backend: str, mib: int, readers: int, calls: int, repeat: int) -> None:
    if backend == "podium":
        import podium.compat.ray as ray
    else:
        import ray
    import torch

    if backend == "ray":
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    else:
        ray.init(num_cpus=16)

    @ray.remote(num_cpus=1)
    class Reader:
        def read(self, tensor):
            return int(tensor.numel())

        def noop(self):
            return None

    @ray.remote(num_cpus=1)
    def noop():
        return None

    def emit(measure: str, **values) -> None:
        print(MARK + json.dumps({"backend": backend, "measure": measure, **values}), flush=True)

    actors = [Reader.remote() for _ in range(readers)]
    ray.get([a.noop.remote() for a in actors])  # all constructed and answering
    value = torch.ones(mib << 18, dtype=torch.float32)  # mib MiB
    nbytes = value.numel() * 4
    put_s, read_s = [], []
    for _ in range(repeat + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        ref = ray.put(value)
        t1 = time.perf_counter()
        counts = ray.get([a.read.remote(ref) for a in actors])
        t2 = time.perf_counter()
        assert counts == [value.numel()] * readers, counts
        put_s.append(t1 - t0)
        read_s.append(t2 - t1)
        del ref
    put_med, read_med = statistics.median(put_s[1:]), statistics.median(read_s[1:])
    emit("put_read", mib=mib, readers=readers, put_s=put_med, read_s=read_med,
         mb_per_s=readers * nbytes / read_med / 1e6, samples_read_s=read_s[1:])

    def rtt(call) -> dict:
        for _ in range(20):
            ray.get(call())
        samples = []
        for _ in range(calls):
            t0 = time.perf_counter()
            ray.get(call())
            samples.append((time.perf_counter() - t0) * 1e6)
        samples.sort()
        return {"median_us": statistics.median(samples), "p90_us": samples[int(0.9 * (len(samples) - 1))],
                "calls": calls}

    emit("task_rtt", **rtt(lambda: noop.remote()))
    emit("actor_rtt", **rtt(lambda: actors[0].noop.remote()))
    ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Run each backend's child, then print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m bench.raysurface", description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["podium", "ray"], choices=["podium", "ray"])
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline of one backend's child (s)")
    parser.add_argument("--json", default=None, help="also write the JSON lines here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, value, low, high in (("--mib", args.mib, 1, 4096), ("--readers", args.readers, 1, 64),
                                   ("--calls", args.calls, 1, 100_000), ("--repeat", args.repeat, 1, 100)):
        if not low <= value <= high:
            parser.error(f"{name} must be in [{low}, {high}]")
    if args.child:
        _child(args.child, args.mib, args.readers, args.calls, args.repeat)
        return 0
    rows = []
    for backend in args.backends:
        cmd = [sys.executable, "-m", "bench.raysurface", "--child", backend, "--mib", str(args.mib),
               "--readers", str(args.readers), "--calls", str(args.calls), "--repeat", str(args.repeat)]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        except subprocess.TimeoutExpired:
            print(f"{backend}: did not finish within {args.timeout:g} s", file=sys.stderr)
            continue
        got = [json.loads(line[len(MARK):]) for line in run.stdout.splitlines() if line.startswith(MARK)]
        if run.returncode != 0 or not got:
            print(f"{backend}: failed (exit {run.returncode}):\n{run.stderr[-3000:]}", file=sys.stderr)
        rows.extend(got)
    if args.json:
        with open(args.json, "w") as out:
            out.writelines(json.dumps(r) + "\n" for r in rows)
    by = {(r["backend"], r["measure"]): r for r in rows}

    def cell(backend: str, measure: str, key: str, fmt: str) -> str:
        row = by.get((backend, measure))
        return format(row[key], fmt) if row else "-"

    print(f"| measure | {' | '.join(args.backends)} |")
    print(f"|---|{'---|' * len(args.backends)}")
    table = [(f"put {args.mib} MiB (s)", "put_read", "put_s", ".3f"),
             (f"{args.readers} readers of it (s)", "put_read", "read_s", ".3f"),
             ("aggregate read MB/s", "put_read", "mb_per_s", ".0f"),
             ("task round trip, median (us)", "task_rtt", "median_us", ".0f"),
             ("task round trip, p90 (us)", "task_rtt", "p90_us", ".0f"),
             ("actor method, median (us)", "actor_rtt", "median_us", ".0f"),
             ("actor method, p90 (us)", "actor_rtt", "p90_us", ".0f")]
    for label, measure, key, fmt in table:
        print(f"| {label} | {' | '.join(cell(b, measure, key, fmt) for b in args.backends)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
