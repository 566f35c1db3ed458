"""Running one backend child per (backend, N) with a deadline, and ending what it left behind.

Shared by ``python -m bench``, ``python -m bench.crosshost`` and ``python -m bench.scale``:
a child is ``python -m bench.podium_side`` or ``bench.ray_side`` (see bench.measure), run in
a session of its own, its BENCHCELL lines read as they come, and every process that carries
its run id ended afterwards.
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
from bench.measure import MARKER, cells_of

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
IMPORT_CHECK = {"podium": "import podium.controller, podium.worker, torch",
                "ray": "import ray, verl.single_controller.ray, torch",
                "verl-podium": "import ray, verl.single_controller.ray, torch; assert ray.__podium__",
                "verl-native": "import ray, verl.single_controller.ray as m, torch; assert m.__podium__"}
MODULE = {"podium": "bench.podium_side", "ray": "bench.ray_side", "verl-podium": "bench.ray_side",
          "verl-native": "bench.ray_side"}
#: verl's own code on Podium: the Ray child under ``podium run`` (Ray mode, native mode).
PODIUM_RUN = {"verl-podium": ["-m", "podium.cli", "run", "--"],
              "verl-native": ["-m", "podium.cli", "run", "--native-verl", "--"]}


def interpreter(args: argparse.Namespace, backend: str) -> str:
    """The interpreter a backend's child runs in: the Ray one wherever verl is needed."""
    return args.podium_python if backend == "podium" else args.ray_python


def _launcher(python: str, backend: str) -> list[str]:
    """What a backend's command runs under: ``podium run`` for verl's code on Podium, else nothing."""
    return [python, *PODIUM_RUN[backend]] if backend in PODIUM_RUN else []


def child_command(python: str, backend: str, module_args: list[str]) -> list[str]:
    """The child's command line."""
    return [*_launcher(python, backend), python, "-m", MODULE[backend], *module_args]


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
    cmd = [*_launcher(python, backend), python, "-c", IMPORT_CHECK[backend]]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=180, env=child_env("import-check"), cwd=REPO_ROOT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"


def usable_backends(args: argparse.Namespace) -> list[str]:
    """The backends of ``args.backends`` that import in their interpreter
    (``args.ray_python`` / ``args.podium_python``); each other one is named on stderr."""
    usable = []
    for backend in args.backends:
        python = interpreter(args, backend)
        reason = importable(python, backend)
        if reason is None:
            usable.append(backend)
        else:
            print(f"{backend}: not measured ({python} cannot import it: {reason})", file=sys.stderr)
    return usable


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
    cmd = child_command(interpreter(args, backend), backend, [
        "--n", str(n), "--payload-mib", *map(str, args.payload_mib),
        "--repeat", str(args.repeat), "--cold-repeat", str(args.cold_repeat),
        "--latency-calls", str(args.latency_calls), "--nonblocking-calls", str(args.nonblocking_calls),
        "--step-timeout", str(args.step_timeout)])
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
    expected = expected_keys(args, n)
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


def expected_keys(args: argparse.Namespace, n: int) -> set[tuple]:
    """The cell keys a child should report for one N (bench.measure.cells_of)."""
    return {report.cell_key(cell) for cell in cells_of(args, n)}


def _progress(cell: dict) -> None:
    if cell.get("measure") == "meta":
        return
    what = f"{cell['backend']:6s} N={cell.get('n')} {cell['measure']}"
    if cell.get("payload_mib") is not None:
        what += f" {cell['payload_mib']} MiB"
    value = f"error: {cell['error']}" if cell.get("error") else f"{cell.get('value'):.4g} {cell.get('unit', '')}"
    print(f"  {what}: {value}", file=sys.stderr, flush=True)
