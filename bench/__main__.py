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
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import uuid

from bench import report
from bench.measure import MARKER

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
IMPORT_CHECK = {"podium": "import podium.controller, podium.worker, torch",
                "ray": "import ray, verl.single_controller.ray, torch"}
MODULE = {"podium": "bench.podium_side", "ray": "bench.ray_side"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", help="workers per group (default 1 2 4 8)")
    parser.add_argument("--payload-mib", type=int, nargs="+", help="DP_COMPUTE_PROTO payloads (default 1 16 128)")
    parser.add_argument("--backends", nargs="+", choices=report.BACKENDS, default=list(report.BACKENDS))
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


def child_env(run_id: str) -> dict[str, str]:
    """The child's environment: the repo on PYTHONPATH (workers unpickle bench.* by name) and
    a run id every descendant inherits, so leftovers are found by it and by nothing broader."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["BENCH_RUN_ID"] = run_id
    env.setdefault("RAY_DEDUP_LOGS", "0")
    return env


def importable(python: str, backend: str) -> str | None:
    """None if ``backend`` imports under ``python``, else the reason it does not."""
    try:
        proc = subprocess.run([python, "-c", IMPORT_CHECK[backend]], capture_output=True, text=True,
                              timeout=180, env=child_env("import-check"), cwd=REPO_ROOT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"


def processes_of_run(run_id: str) -> list[int]:
    """Pids of live processes whose environment carries this run's BENCH_RUN_ID."""
    needle = f"BENCH_RUN_ID={run_id}".encode()
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def reap_run(run_id: str) -> list[int]:
    """End what a child left behind (Ray daemons, worker processes): SIGTERM, then SIGKILL."""
    pids = processes_of_run(run_id)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (pids := processes_of_run(run_id)):
            time.sleep(0.2)
        if not pids:
            break
    return pids


def run_child(args: argparse.Namespace, backend: str, n: int) -> list[dict]:
    """Run one backend child for one N; returns its cells (missing ones become errors)."""
    python = args.ray_python if backend == "ray" else args.podium_python
    cmd = [python, "-m", MODULE[backend], "--n", str(n), "--payload-mib", *map(str, args.payload_mib),
           "--repeat", str(args.repeat), "--cold-repeat", str(args.cold_repeat),
           "--latency-calls", str(args.latency_calls), "--nonblocking-calls", str(args.nonblocking_calls),
           "--step-timeout", str(args.step_timeout)]
    steps = 5 + len(args.payload_mib) + 2 * max(1, args.cold_repeat)
    budget = args.step_timeout * steps + 60
    run_id = uuid.uuid4().hex
    log_path = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-{backend}-n{n}-{run_id[:8]}.log"
    cells: list[dict] = []
    failure = None
    with open(log_path, "w") as log:
        # Our own session, so a stuck child can be interrupted as a group without
        # touching this terminal's other processes.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO_ROOT,
                                env=child_env(run_id), start_new_session=True)
        deadline = time.monotonic() + budget
        try:
            # Reading line by line keeps partial results; the timer enforces the budget, and
            # reaps by run id too, since a descendant holding our pipe would keep this loop open.
            timer = threading.Timer(budget, lambda: (_interrupt(proc), reap_run(run_id)))
            timer.start()
            for line in proc.stdout:
                if line.startswith(MARKER):
                    cell = json.loads(line[len(MARKER):])
                    cells.append(cell)
                    _progress(cell)
            proc.wait()
            timer.cancel()
            if time.monotonic() > deadline:
                failure = f"child ran past its {budget:.0f} s deadline"
            elif proc.returncode:
                failure = f"child exited with {proc.returncode}"
        except KeyboardInterrupt:
            _interrupt(proc)
            raise
        finally:
            left = reap_run(run_id)
            if left:
                print(f"warning: could not end pids {left} of the {backend} child", file=sys.stderr)
    if failure:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        failure += f" (log {log_path}: {' / '.join(tail)[-300:]})"
    expected = _expected_keys(args, n)
    got = {report.cell_key(c) for c in cells}
    for key in expected - got:
        measure, _, mib = key
        cell = {"backend": backend, "measure": measure, "n": n, "error": failure or "no result"}
        if mib is not None:
            cell["payload_mib"] = mib
        cells.append(cell)
    return cells


def _interrupt(proc: subprocess.Popen) -> None:
    """SIGINT the child's group (Python cleans up: ray.shutdown / podium shutdown), then SIGKILL."""
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _expected_keys(args: argparse.Namespace, n: int) -> set[tuple]:
    keys = {(m, n, None) for m in ("cluster_start_s", "cold_start_s", "noop_latency_median_ms", "noop_latency_p90_ms",
                                    "nonblocking_calls_s", "cold_start_torch_s")}
    return keys | {("dp_proto_mb_s", n, mib) for mib in args.payload_mib}


def _progress(cell: dict) -> None:
    if cell.get("measure") == "meta":
        return
    what = f"{cell['backend']:6s} N={cell.get('n')} {cell['measure']}"
    if cell.get("payload_mib") is not None:
        what += f" {cell['payload_mib']} MiB"
    value = f"error: {cell['error']}" if cell.get("error") else f"{cell.get('value'):.4g} {cell.get('unit', '')}"
    print(f"  {what}: {value}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run every (N, backend) child, then print the tables and the JSON lines."""
    args = parse_args(argv)
    if args.from_json:
        cells = report.cells_from_json_lines(pathlib.Path(args.from_json).read_text().splitlines())
        print(report.tables(report.pair_cells(cells), {c["backend"] for c in cells}))
        print(report.breakdown_table(cells))
        return 0
    cells: list[dict] = []
    backends = []
    for backend in args.backends:
        python = args.ray_python if backend == "ray" else args.podium_python
        reason = importable(python, backend)
        if reason is None:
            backends.append(backend)
        else:
            print(f"{backend}: not measured ({python} cannot import it: {reason})", file=sys.stderr)
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
