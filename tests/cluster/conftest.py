"""Fixtures for cluster tests: real ``podium`` processes started as subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The fake node agent of the integration tests is reused here (a real gRPC server).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

_START_TIMEOUT = 60.0


class SchedulerProcess:
    """One ``podium scheduler`` subprocess with free ports, read from its --port-file."""

    def __init__(self, state: Path, token: str, workdir: Path, *extra: str) -> None:
        self.state, self.token, self.workdir, self.extra = state, token, workdir, extra
        self.proc: subprocess.Popen | None = None
        self.port = self.http_port = 0

    def start(self) -> "SchedulerProcess":
        """Start it and wait (with a deadline) until both servers serve."""
        port_file = self.workdir / f"ports-{time.monotonic_ns()}.json"
        env = dict(os.environ, PODIUM_TOKEN=self.token)
        self.log = open(self.workdir / "scheduler.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "podium.cli", "scheduler", "--host", "127.0.0.1", "--port", "0",
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
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """HTTP base URL."""
        return f"http://127.0.0.1:{self.http_port}"

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


@pytest.fixture
def scheduler_process(tmp_path, token):
    """Factory: ``scheduler_process(state_path, *extra_flags)`` starts one; all are killed at teardown."""
    started: list[SchedulerProcess] = []

    def start(state: Path | None = None, *extra: str) -> SchedulerProcess:
        proc = SchedulerProcess(state or tmp_path / "scheduler.db", token, tmp_path, *extra).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
