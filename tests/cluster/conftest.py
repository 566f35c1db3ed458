"""Fixtures for cluster tests: real ``podium`` processes started as subprocesses."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.support.processes import AgentProcess, SchedulerProcess


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


@pytest.fixture
def agents(tmp_path, token):
    """Factory ``agents(scheduler_address, host, *flags)``; every agent is killed at teardown."""
    started: list[AgentProcess] = []

    def start(scheduler: str, host: str, *extra: str) -> AgentProcess:
        agent = AgentProcess(tmp_path, scheduler, host, token, *extra)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        if agent.proc.poll() is None:
            agent.signal(signal.SIGKILL)
