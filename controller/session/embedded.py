"""The embedded cluster of ``init()`` without an address: a scheduler and one node agent on
127.0.0.1, started as child processes with a fresh random token (and stopped by the runtime).
CPUs and GPUs not given to ``init()`` are ``podium run --num-cpus/--num-gpus`` where those were
given (``PODIUM_RAY_NUM_CPUS``/``PODIUM_RAY_NUM_GPUS``), whichever call starts the cluster.

Split from :mod:`podium.controller.session.runtime`, which keeps the names importable.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import tempfile
import time

from podium.errors import DeadlineExceededError, UnavailableError
from podium.private import given_dir, open_private, private_dir, read_port_file
from podium.process import die_with_parent_argv

__all__ = ["DEFAULT_FAKE_GPUS", "STARTUP_TIMEOUT", "start_embedded", "stop_process"]

#: Fake GPUs of an embedded cluster on a machine without NVML GPUs.
DEFAULT_FAKE_GPUS = 8
#: How long the embedded services may take to come up.
STARTUP_TIMEOUT = 60.0


def _nvml_gpu_count() -> int:
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library, no GPU: all mean "none"
        return 0


def _stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(5)


def _wait_port_file(path: pathlib.Path, proc: subprocess.Popen, what: str, log_path: pathlib.Path,
                    timeout: float = STARTUP_TIMEOUT) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # Only the file this child wrote: not a stale one of an earlier run in a reused log_dir.
        payload = read_port_file(path, proc.pid)
        if payload is not None:
            return payload
        if proc.poll() is not None:
            tail = log_path.read_text()[-2000:] if log_path.exists() else ""
            raise UnavailableError(f"the embedded {what} exited with code {proc.returncode}:\n{tail}")
        time.sleep(0.05)
    raise DeadlineExceededError(f"the embedded {what} did not start within {timeout:g}s (log: {log_path})")


def _embedded_argv(role: str, *args: str) -> list[str]:
    # SIGTERM, not SIGKILL, when the controller dies: the agent then stops its workers.
    # (podium.process explains why a shim and not a preexec_fn.)
    return die_with_parent_argv([sys.executable, "-m", "podium.cli", role, *args], signal.SIGTERM)


def _tls_args(tls) -> list[str]:
    return ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca] if tls else []


def _start_embedded(num_gpus: int | None, num_cpus: float | None, log_dir: str | None, tls=None,
                    resources: dict[str, float] | None = None) -> tuple[str, str, list[subprocess.Popen], str]:
    token = secrets.token_urlsafe(32)
    # A given folder must be one no other user can plant sockets, port files or links in (#48).
    root = given_dir(log_dir, "init(log_dir=)") if log_dir else pathlib.Path(tempfile.mkdtemp(prefix="podium-"))
    private_dir(root)  # 0700 (mkdtemp's already is), its logs 0600, whatever the umask (#34)
    env = dict(os.environ, PODIUM_TOKEN=token, PYTHONUNBUFFERED="1")
    env.pop("PODIUM_TOKEN_FILE", None)
    for key in ("PODIUM_TLS_CERT", "PODIUM_TLS_KEY", "PODIUM_TLS_CA"):
        env.pop(key, None)  # the services get TLS from their flags, as given to init()
    # podium run --num-cpus/--num-gpus size the embedded cluster whichever call starts it:
    # ray.init(), podium.init(), or the first remote call without either.
    if num_cpus is None and os.environ.get("PODIUM_RAY_NUM_CPUS"):
        num_cpus = float(os.environ["PODIUM_RAY_NUM_CPUS"])
    if num_gpus is None and os.environ.get("PODIUM_RAY_NUM_GPUS"):
        num_gpus = int(os.environ["PODIUM_RAY_NUM_GPUS"])
    if num_gpus is None:
        num_gpus = DEFAULT_FAKE_GPUS if _nvml_gpu_count() == 0 else None
    gpus_for_cpu = num_gpus if num_gpus is not None else _nvml_gpu_count()
    if num_cpus is None:
        # Bundle CPUs are colocation slots (verl asks max_colocate_count per bundle), not
        # cores: offer enough for every GPU to hold a full default bundle of 10 and more.
        num_cpus = max(os.cpu_count() or 1, 16 * max(gpus_for_cpu, DEFAULT_FAKE_GPUS))
    processes: list[subprocess.Popen] = []
    try:
        sched_file, sched_log = root / "scheduler.port.json", root / "scheduler.log"
        with open_private(sched_log, "ab") as out:
            processes.append(subprocess.Popen(
                _embedded_argv("scheduler", "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                               "--state", ":memory:", "--port-file", str(sched_file), *_tls_args(tls)),
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        port = _wait_port_file(sched_file, processes[0], "scheduler", sched_log)["port"]
        address = f"127.0.0.1:{port}"
        node_file, node_log = root / "node.port.json", root / "node.log"
        args = ["--scheduler", address, "--host", "127.0.0.1", "--port-file", str(node_file),
                "--cpus", str(num_cpus), "--log-dir", str(root / "workers"), *_tls_args(tls)]
        if num_gpus is not None:
            args += ["--fake-gpus", str(num_gpus)]
        if resources:  # custom resources of the embedded node (ray.init(resources=...))
            args += ["--resources", json.dumps(resources)]
        with open_private(node_log, "ab") as out:
            processes.append(subprocess.Popen(_embedded_argv("node", *args), env=env, stdout=out,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        _wait_port_file(node_file, processes[1], "node agent", node_log)
    except BaseException:
        for proc in reversed(processes):
            _stop_process(proc)
        raise
    return address, token, processes, str(root)


#: Public names of the two entry points the runtime uses.
start_embedded = _start_embedded
stop_process = _stop_process
