"""Shared pieces of the fault-injection tests (``tests/cluster/test_faults_*.py``).

A fault cluster is one real ``podium scheduler`` with short leases and real ``podium node``
agents on their own loopback addresses (the helpers of ``conftest.py`` and
``test_agents_processes.py``), joined by this test process as the controller. Every test
prints what it measured (``FAULT <name>: <seconds> s: <what the user saw>``) for the closing
note's table (``pytest -s``, or ``PODIUM_FAULT_REPORT=<file>`` to collect the lines);
detection times are only printed, each test waits with a stated deadline instead.

    PODIUM_FAULT_REPORT=/tmp/faults.txt python -m pytest -q -m faults tests/cluster
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

from tests.support.processes import AgentProcess, wait_for  # noqa: F401 - re-exported
from tests.support.proctable import alive, descendants  # noqa: F401 - re-exported

import podium

#: Heartbeat interval told to the agents, and node lease (seconds): short for quick tests,
#: yet six beats long, so a busy 2-core machine does not lose a live node.
HEARTBEAT = 0.5
NODE_LEASE = 3.0
#: Session lease of the controller that is made to vanish (seconds); the scheduler's default.
SESSION_LEASE = 5.0
#: Session lease of the test process itself: long, so a stalled keep-alive cannot lose it.
OWN_SESSION_LEASE = 60.0
#: Default deadline of a test's wait.
DEADLINE = 30.0
#: Flags of a fault cluster's scheduler.
SCHEDULER_FLAGS = ("--heartbeat-interval", str(HEARTBEAT), "--node-lease", str(NODE_LEASE),
                   "--session-lease", str(SESSION_LEASE))


def report(fault: str, seconds: float, saw: str) -> None:
    """Print one row of the closing note's table (visible with ``pytest -s`` / in the log)."""
    line = f"FAULT {fault}: {seconds:.3f} s: {saw.splitlines()[0][:200] if saw else ''}"
    print(line, file=sys.stderr)
    path = os.environ.get("PODIUM_FAULT_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(line + "\n")


def http_json(url: str, token: str) -> dict:
    """GET a /v1 endpoint with the token."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


class FaultCluster:
    """A scheduler process with short leases, agents by host, and the controller runtime."""

    def __init__(self, scheduler_process, agents, token: str, hosts: tuple[str, ...],
                 state: Path | None = None, agent_flags: tuple[str, ...] = ()) -> None:
        self.token = token
        self._start_agent = agents
        self.agent_flags = agent_flags
        self.scheduler = scheduler_process(state, *SCHEDULER_FLAGS)
        self.agents: dict[str, AgentProcess] = {}
        for host in hosts:
            self.add_agent(host)
        self.runtime = None

    def add_agent(self, host: str) -> AgentProcess:
        """Start a node agent on ``host`` and wait until the scheduler lists it alive."""
        agent = self._start_agent(self.scheduler.address, host, "--cpus", "8", *self.agent_flags)
        self.agents[host] = agent
        wait_for(lambda: self.node_state(agent.node_id) == "NODE_ALIVE", f"node {host} alive")
        return agent

    def connect(self, call_timeout: float = 60.0, session_lease: float = OWN_SESSION_LEASE):
        """``controller.init`` against this cluster (shut down by the fixture)."""
        self.runtime = podium.init(address=self.scheduler.address, token=self.token,
                                       call_timeout=call_timeout, session_lease=session_lease)
        return self.runtime

    def placement(self) -> dict:
        """The scheduler's /v1/placement."""
        return http_json(self.scheduler.http_url + "/v1/placement", self.token)

    def node_state(self, node_id: str) -> str:
        """NODE_ALIVE / NODE_DEAD / '' as /v1/placement shows it."""
        for node in self.placement()["nodes"]:
            if node["node_id"] == node_id:
                return node["state"]
        return ""

    def busy(self) -> tuple[list, list]:
        """(live placement groups, live workers) of /v1/placement: empty when all is free."""
        view = self.placement()
        workers = [w for node in view["nodes"] for gpu in node["gpus"] for w in gpu["workers"]]
        groups = [g for g in view["placement_groups"] if g["state"] != "PG_REMOVED"]
        return groups, workers

    def close(self) -> None:
        """Shut the controller down; the fixtures stop the processes."""
        podium.shutdown()
        self.runtime = None


def stop_and_cont(pid: int) -> None:
    """SIGCONT a stopped process (teardown of a SIGSTOP test), ignoring one that is gone."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def elapsed(since: float) -> float:
    """Seconds since a ``time.monotonic()`` reading."""
    return time.monotonic() - since
