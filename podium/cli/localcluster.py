"""A local multi-node cluster for a laptop: ``podium up`` / ``podium down``.

``up`` starts one ``podium scheduler`` on 127.0.0.1 and N ``podium node`` agents on
127.0.0.2, 127.0.0.3, ... (each "machine" has its own loopback address, as in the
cluster tests), as daemons in their own sessions, so they outlive the shell command.
Everything they need is in one state directory (default ``~/.podium/local``)::

    cluster.json     address, HTTP URL, token file, the pid/ports of every process (with
                     each node agent's Prometheus /metrics port)
    token            the cluster token (0600)
    scheduler.db     the scheduler's state (removed by ``down``)
    logs/            scheduler.log, node-127.0.0.2.log, ...
    workers/NODE/    the workers' stdout/stderr files, per node

``down`` stops the agents first (SIGTERM: each stops its workers), then the
scheduler, with SIGKILL after a grace period; nothing it started is left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field

from podium.auth import resolve_token
from podium.private import given_dir, open_private, private_dir, read_port_file, write_private_atomic
from podium.errors import DeadlineExceededError, FailedPreconditionError, InvalidArgumentError, UnavailableError

__all__ = ["DEFAULT_DIR", "LocalCluster", "ProcessRecord", "up", "down", "load", "node_address"]

#: Default state directory of the local cluster.
DEFAULT_DIR = pathlib.Path("~/.podium/local")
#: How long ``up`` waits for every process to serve and every node to register.
START_TIMEOUT = 60.0
STATE_FILE = "cluster.json"


def node_address(index: int) -> str:
    """Loopback address of local node ``index`` (0 -> 127.0.0.2; the scheduler has .1)."""
    if not 0 <= index < 250:
        raise InvalidArgumentError(f"a local cluster has at most 250 nodes, asked for node {index}")
    return f"127.0.0.{index + 2}"


@dataclass
class ProcessRecord:
    """One daemon ``up`` started."""

    role: str
    pid: int
    address: str
    port: int
    log: str
    #: Port of the Prometheus /metrics endpoint (node agents; the scheduler's is its HTTP port).
    metrics_port: int = 0


@dataclass
class LocalCluster:
    """What ``up`` wrote to ``cluster.json``: enough to use, inspect and stop the cluster."""

    dir: str
    address: str
    http_url: str
    token_file: str
    scheduler: ProcessRecord
    nodes: list[ProcessRecord] = field(default_factory=list)

    def token(self) -> str:
        """The cluster token."""
        return pathlib.Path(self.token_file).read_text().strip()

    def processes(self) -> list[ProcessRecord]:
        """Agents first, then the scheduler (the order ``down`` stops them in)."""
        return [*self.nodes, self.scheduler]


def load(directory: str | os.PathLike = DEFAULT_DIR) -> LocalCluster | None:
    """The cluster recorded in ``directory`` (None if there is none)."""
    path = pathlib.Path(directory).expanduser() / STATE_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    raw["scheduler"] = ProcessRecord(**raw["scheduler"])
    raw["nodes"] = [ProcessRecord(**n) for n in raw["nodes"]]
    return LocalCluster(**raw)


def _alive(pid: int) -> bool:
    """True if ``pid`` runs a podium process (a recycled pid of another program is not ours)."""
    try:
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        return False
    return b"podium" in cmdline


def _spawn(argv: list[str], log_path: pathlib.Path, env: dict) -> subprocess.Popen:
    private_dir(log_path.parent)
    with open_private(log_path, "ab") as out:
        # Own session: the daemon outlives this command and its terminal's SIGINT.
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, close_fds=True)


def _wait_file(path: pathlib.Path, proc: subprocess.Popen, log_path: pathlib.Path,
               deadline: float) -> dict:
    argv = [str(a) for a in proc.args]  # type: ignore[union-attr]  # always a list here
    while True:
        payload = read_port_file(path, proc.pid)  # only the file this child wrote
        if payload is not None:
            return payload
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
            raise UnavailableError(f"{' '.join(argv[3:5])} exited with code "
                                   f"{proc.returncode}; its log ({log_path}) ends:\n{tail}")
        if time.monotonic() > deadline:
            raise DeadlineExceededError(f"{argv[3]} did not start in time (log: {log_path})")
        time.sleep(0.05)


def _wait_nodes(http_url: str, token: str, count: int, deadline: float) -> None:
    request = urllib.request.Request(f"{http_url}/v1/nodes", headers={"Authorization": f"Bearer {token}"})
    alive = 0
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(request, timeout=5) as reply:
                nodes = json.loads(reply.read())["nodes"]
            alive = sum(1 for n in nodes if n.get("state") == "NODE_ALIVE")
            if alive >= count:
                return
        time.sleep(0.1)
    raise DeadlineExceededError(f"only {alive} of {count} nodes registered in time")


def up(directory: str | os.PathLike = DEFAULT_DIR, *, nodes: int = 2, gpus_per_node: int | None = 4,
       cpus_per_node: float | None = None, port: int = 50051, http_port: int = 8265,
       token: str | None = None, timeout: float = START_TIMEOUT) -> LocalCluster:
    """Start the scheduler and ``nodes`` agents (fake GPUs unless ``gpus_per_node`` is None,
    which asks NVML), wait until every node is registered, record and return the cluster.

    FailedPreconditionError if a cluster recorded in ``directory`` still runs.
    """
    if nodes < 1:
        raise InvalidArgumentError(f"--nodes must be >= 1, got {nodes}")
    root = given_dir(directory, "podium up --dir")  # no other user can plant files there (#48)
    existing = load(root)
    if existing is not None:
        if any(_alive(p.pid) for p in existing.processes()):
            raise FailedPreconditionError(
                f"a local cluster already runs from {root} (address {existing.address}); "
                f"`podium down --dir {root}` first")
        (root / STATE_FILE).unlink()
    private_dir(root)  # 0700 with its logs/ and workers/, whatever the umask (#34)
    token_file = root / "token"
    # The usual lookup (PODIUM_TOKEN, PODIUM_TOKEN_FILE, ~/.podium/token, created if
    # missing), so a script's init(address=...) finds the same token with no setup.
    token = resolve_token(token, create=True)
    token_file.unlink(missing_ok=True)
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    env = dict(os.environ, PODIUM_TOKEN=token, PYTHONUNBUFFERED="1")
    env.pop("PODIUM_TOKEN_FILE", None)
    with contextlib.suppress(FileNotFoundError):
        (root / "scheduler.db").unlink()
    deadline = time.monotonic() + timeout
    cli = [sys.executable, "-m", "podium.cli"]
    started: list[subprocess.Popen] = []
    try:
        port_file, log_path = root / "scheduler.port.json", root / "logs" / "scheduler.log"
        port_file.unlink(missing_ok=True)
        sched = _spawn([*cli, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--http-port",
                        str(http_port), "--state", str(root / "scheduler.db"), "--port-file",
                        str(port_file)], log_path, env)
        started.append(sched)
        ports = _wait_file(port_file, sched, log_path, deadline)
        address = f"127.0.0.1:{ports['port']}"
        http_url = f"http://127.0.0.1:{ports['http_port']}"
        scheduler = ProcessRecord("scheduler", sched.pid, "127.0.0.1", ports["port"], str(log_path),
                                  ports["http_port"])
        records: list[ProcessRecord] = []
        pending = []
        for i in range(nodes):
            host = node_address(i)
            port_file, log_path = root / f"node-{host}.port.json", root / "logs" / f"node-{host}.log"
            port_file.unlink(missing_ok=True)
            argv = [*cli, "node", "--scheduler", address, "--host", host, "--port-file", str(port_file),
                    "--log-dir", str(root / "workers" / host), "--node-id", f"node-{host}",
                    "--metrics-port", "0"]
            if gpus_per_node is not None:
                argv += ["--fake-gpus", str(gpus_per_node)]
            if cpus_per_node is None:
                # Bundle CPUs are colocation slots (verl asks max_colocate_count per bundle),
                # not cores: offer as many as the embedded cluster does.
                cpus_per_node = max(os.cpu_count() or 1, 16 * max(gpus_per_node or 8, 1))
            argv += ["--cpus", f"{cpus_per_node:g}"]
            proc = _spawn(argv, log_path, env)
            started.append(proc)
            pending.append((host, port_file, proc, log_path))
        for host, port_file, proc, log_path in pending:
            info = _wait_file(port_file, proc, log_path, deadline)
            records.append(ProcessRecord("node", proc.pid, host, int(info["port"]), str(log_path),
                                         int(info.get("metrics_port", 0))))
        _wait_nodes(http_url, token, nodes, deadline)
    except BaseException:
        for proc in reversed(started):
            _stop_pids([proc.pid], grace=5.0)
            with contextlib.suppress(Exception):
                proc.wait(1)
        raise
    cluster = LocalCluster(dir=str(root), address=address, http_url=http_url, token_file=str(token_file),
                           scheduler=scheduler, nodes=records)
    write_private_atomic(root / STATE_FILE, json.dumps(asdict(cluster), indent=1))
    return cluster


def _stop_pids(pids: list[int], grace: float) -> list[int]:
    """SIGTERM every live pid, wait up to ``grace`` s, SIGKILL the rest; returns the pids
    that were alive."""
    alive = [pid for pid in pids if _alive(pid)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(pid) for pid in alive):
        time.sleep(0.05)
    for pid in alive:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(pid) for pid in alive):
        time.sleep(0.05)
    return alive


def down(directory: str | os.PathLike = DEFAULT_DIR, *, grace: float = 15.0) -> LocalCluster | None:
    """Stop what ``up`` started in ``directory`` (agents, which stop their workers, then the
    scheduler); returns the cluster that was recorded (None if there was none)."""
    root = pathlib.Path(directory).expanduser().resolve()
    cluster = load(root)
    if cluster is None:
        return None
    # Agents first: on SIGTERM each stops its workers; the scheduler goes last so the
    # agents' final reports still reach it.
    _stop_pids([n.pid for n in cluster.nodes], grace)
    _stop_pids([cluster.scheduler.pid], grace)
    (root / STATE_FILE).unlink(missing_ok=True)
    with contextlib.suppress(FileNotFoundError):
        (root / "scheduler.db").unlink()
    return cluster
