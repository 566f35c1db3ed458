"""Real Podium processes for tests: a ``podium scheduler``, ``podium node`` agents on their own
loopback addresses, and a worker started as the node agent starts one (the ready-fd contract).
Each reads its ports from a file the process writes, within a deadline."""

from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.waiting import DEADLINE, REPO, eventually

__all__ = ["AgentProcess", "SchedulerProcess", "WorkerProcess", "spawn_worker", "wait_for", "FAKE_WORKER"]

#: The fake worker an agent can run instead of the real host (same bootstrap contract).
FAKE_WORKER = REPO / "tests" / "support" / "agent_fake_worker.py"
READY_DEADLINE = 60.0
_START_TIMEOUT = 60.0


def wait_for(predicate, what: str, timeout: float = DEADLINE):
    """Poll until ``predicate()`` is truthy; fail naming ``what`` (see :func:`eventually`)."""
    return eventually(predicate, what, timeout)


class AgentProcess:
    """One ``podium node`` subprocess, its address and port read from its --port-file."""

    def __init__(self, workdir: pathlib.Path, scheduler: str, host: str, token: str, *extra: str,
                 launch=subprocess.Popen) -> None:
        # ``launch`` starts the argv (``NetLab.popen`` on a lab host puts it in its namespace).
        self.host = host
        self.port_file = workdir / f"agent-{host}.json"
        self.log_dir = workdir / f"logs-{host}"
        self.output = open(workdir / f"agent-{host}.log", "ab")
        env = dict(os.environ, PODIUM_TOKEN=token)
        self.proc = launch(
            [sys.executable, "-m", "podium.cli", "node", "--scheduler", scheduler, "--host", host,
             "--fake-gpus", "2", "--cpus", "4", "--log-dir", str(self.log_dir),
             "--port-file", str(self.port_file), "--stop-grace", "1", *extra],
            env=env, stdout=self.output, stderr=subprocess.STDOUT)
        wait_for(lambda: self.port_file.exists() or self.proc.poll() is not None, f"agent {host} to serve")
        assert self.proc.poll() is None, (workdir / f"agent-{host}.log").read_text()[-3000:]
        info = json.loads(self.port_file.read_text())
        assert info["pid"] == self.proc.pid and info["address"] == host
        self.port, self.node_id = info["port"], info["node_id"]

    def signal(self, sig: int) -> int:
        """Send ``sig`` and reap (with a deadline); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=DEADLINE)
        finally:
            self.output.close()


class SchedulerProcess:
    """One ``podium scheduler`` subprocess with free ports, read from its --port-file."""

    def __init__(self, state: Path, token: str, workdir: Path, *extra: str, host: str = "127.0.0.1",
                 launch=subprocess.Popen) -> None:
        self.state, self.token, self.workdir, self.extra = state, token, workdir, extra
        self.host, self.launch = host, launch
        self.proc: subprocess.Popen | None = None
        self.port = self.http_port = 0

    def start(self) -> "SchedulerProcess":
        """Start it and wait (with a deadline) until both servers serve."""
        port_file = self.workdir / f"ports-{time.monotonic_ns()}.json"
        env = dict(os.environ, PODIUM_TOKEN=self.token)
        self.log = open(self.workdir / "scheduler.log", "ab")
        self.proc = self.launch(
            [sys.executable, "-m", "podium.cli", "scheduler", "--host", self.host, "--port", "0",
             "--http-port", "0", "--state", str(self.state), "--port-file", str(port_file),
             *self.extra], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _START_TIMEOUT
        while not port_file.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"scheduler exited with {self.proc.returncode}: "
                                     f"{(self.workdir / 'scheduler.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("scheduler did not write its port file in time")
            time.sleep(0.05)
        ports = json.loads(port_file.read_text())
        assert ports["pid"] == self.proc.pid
        self.port, self.http_port = ports["port"], ports["http_port"]
        return self

    @property
    def address(self) -> str:
        """gRPC address."""
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        """HTTP base URL."""
        return f"http://{self.host}:{self.http_port}"

    def kill(self, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` and reap; returns the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=30)
        finally:
            self.log.close()
        self.proc = None
        return code


class WorkerProcess:
    """A worker host process and the port it announced on its ready fd."""

    def __init__(self, proc: subprocess.Popen, port: int, address: str, log_path: str) -> None:
        self.proc = proc
        self.port = port
        self.address = f"{address}:{port}"
        self.log_path = log_path

    def log(self) -> str:
        """What the process wrote to stderr/stdout so far."""
        with open(self.log_path, errors="replace") as handle:
            return handle.read()

    def stop(self) -> None:
        """Kill it if it still runs and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def spawn_worker(tmp_path, token: str, *, rank: int = 0, world_size: int = 1,
                 address: str = "127.0.0.1", extra_env: dict | None = None) -> WorkerProcess:
    """Start ``python -m podium.worker.host --ready-fd`` as the agent does; wait for its port."""
    read_fd, write_fd = os.pipe()
    env = dict(os.environ)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": address,
                "MASTER_PORT": "29500", "CUDA_VISIBLE_DEVICES": "", "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1", "WG_PREFIX": "test", "WG_BACKEND": "podium",
                "PODIUM_LOCAL_WORLD_SIZE": str(world_size), "RAY_LOCAL_WORLD_SIZE": str(world_size),
                "PODIUM_WORKER_ID": f"w-test-{rank}", "PODIUM_NODE_ADDRESS": address,
                "PODIUM_TOKEN": token, "PODIUM_SCHEDULER": ""})
    env.update(extra_env or {})
    log_path = str(tmp_path / f"worker-{rank}-{time.monotonic_ns()}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "podium.worker.host", "--ready-fd", str(write_fd)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(write_fd,))
    os.close(write_fd)
    try:
        data = b""
        deadline = time.monotonic() + READY_DEADLINE
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                proc.kill()
                proc.wait(timeout=30)
                with open(log_path, errors="replace") as handle:
                    raise AssertionError(f"worker never became ready; log:\n{handle.read()}")
            ready, _, _ = select.select([read_fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(read_fd, 4096)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(read_fd)
    port = json.loads(data.decode())["port"]
    return WorkerProcess(proc, port, address, log_path)
