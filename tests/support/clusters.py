"""Clusters the controller tests run on: the embedded one, and 2 real nodes on loopback.

``controller_cluster(kind, tmp_dir)`` is a context manager that leaves ``podium.controller``
initialised against the cluster and tears everything down afterwards:

* ``"embedded"``: ``init()`` (a scheduler and one node agent as child processes, 8 fake GPUs);
* ``"two_nodes"``: a ``podium scheduler`` process and two ``podium node`` processes on
  127.0.0.2 and 127.0.0.3 (``gpus_per_node`` fake GPUs each), joined with ``init(address=...)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import time

import podium

#: Node addresses of the two-node cluster, in rank order.
TWO_NODES = ("127.0.0.2", "127.0.0.3")


def _wait_port_file(path: pathlib.Path, proc: subprocess.Popen, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            with contextlib.suppress(ValueError):
                return json.loads(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[3]} exited with {proc.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"{path} was not written within {timeout}s")


@dataclasses.dataclass
class Processes:
    """A running two-node cluster: its scheduler address, token and agent processes."""

    address: str
    token: str
    #: node address -> its ``podium node`` process.
    agents: dict[str, subprocess.Popen]
    #: The scheduler's HTTP port.
    http_port: int = 0
    #: node address -> its agent's gRPC "host:port".
    agent_addresses: dict[str, str] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def two_node_processes(tmp: pathlib.Path, gpus_per_node: int = 4, *, state: str = ":memory:",
                       cpus: int = 64, flags: tuple[str, ...] = ()):
    """Yield :class:`Processes` of a scheduler + 2 node agent processes; all stopped after.

    ``flags`` go to every process (e.g. ``--tls-cert ...``); TLS settings in this process's
    environment do not."""
    token = secrets.token_urlsafe(16)
    env = dict(os.environ, PODIUM_TOKEN=token)
    for key in ("PODIUM_TOKEN_FILE", "PODIUM_TLS_CERT", "PODIUM_TLS_KEY", "PODIUM_TLS_CA"):
        env.pop(key, None)
    procs: list[subprocess.Popen] = []

    def start(name: str, args: list[str]) -> subprocess.Popen:
        with open(tmp / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "podium.cli", *args, *flags], env=env,
                                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        return procs[-1]

    try:
        sched = start("scheduler", ["scheduler", "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                                    "--state", state, "--port-file", str(tmp / "scheduler.json")])
        ports = _wait_port_file(tmp / "scheduler.json", sched)
        address = f"127.0.0.1:{ports['port']}"
        agents, agent_addresses = {}, {}
        # Started in reverse address order: rank order must still follow node addresses.
        for host in reversed(TWO_NODES):
            agents[host] = start(host, ["node", "--scheduler", address, "--host", host, "--fake-gpus",
                                        str(gpus_per_node), "--cpus", str(cpus), "--port-file",
                                        str(tmp / f"{host}.json"), "--log-dir", str(tmp / host)])
            agent_addresses[host] = f"{host}:{_wait_port_file(tmp / f'{host}.json', agents[host])['port']}"
        yield Processes(address, token, agents, ports.get("http_port", 0), agent_addresses)
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


@contextlib.contextmanager
def controller_cluster(kind: str, tmp: pathlib.Path, gpus_per_node: int = 4):
    """Initialise podium.controller on a cluster of ``kind`` (see the module docstring)."""
    if kind == "embedded":
        podium.init()
        try:
            yield
        finally:
            podium.shutdown()
        return
    assert kind == "two_nodes", kind
    with two_node_processes(tmp, gpus_per_node) as cluster:
        rt = podium.init(address=cluster.address, token=cluster.token)
        try:
            deadline = time.monotonic() + 30
            while len(rt.run(rt.cluster_state()).nodes) < len(TWO_NODES):
                assert time.monotonic() < deadline, "the node agents did not register"
                time.sleep(0.1)
            yield
        finally:
            podium.shutdown()
