"""A one-machine Slurm cluster for tests: munged, slurmctld and two slurmd as our own processes.

Everything lives in one temporary directory (config, munge key and socket, state, spool,
logs); the daemons run in the foreground as children of the test, on free ports, and
:meth:`SlurmCluster.stop` ends exactly those pids. The two Slurm nodes, n1 and n2, are
two slurmd on this machine (``slurmd -N``, each on its own port; NodeHostname is this
host's name, NodeAddr 127.0.0.1), so jobs span two nodes as on a real cluster. Needs root (SlurmUser=root, and
slurmd starts job steps as the submitting user) and the Debian packages ``slurm-wlm``
and ``munge``; :func:`missing` says what is absent.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

#: Programs the cluster needs, and the package that ships them.
PROGRAMS = {"munged": "munge", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm",
            "sbatch": "slurm-wlm", "scancel": "slurm-wlm", "sinfo": "slurm-wlm",
            "squeue": "slurm-wlm"}
#: CPUs each node offers: more than the machine has is fine (config_overrides).
NODE_CPUS = 4
#: The Slurm node names.
NODES = ("n1", "n2")
START_TIMEOUT = 60.0


def missing() -> str | None:
    """Why this machine cannot run the cluster (None when it can)."""
    if os.geteuid() != 0:
        return "the Slurm test runs slurmd/slurmctld with SlurmUser=root: needs root"
    absent = sorted({f"{prog} ({pkg})" for prog, pkg in PROGRAMS.items() if shutil.which(prog) is None})
    if absent:
        return "missing Debian packages slurm-wlm/munge: no " + ", ".join(absent)
    return None


#: Where the daemons' ports are drawn from: below Linux's ephemeral range (32768-60999), so
#: no client connection of the rest of the suite takes one between the draw and the bind.
PORT_RANGE = (20000, 32000)
#: Starts tried before giving up when a daemon still finds its port taken.
START_TRIES = 3


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports of :data:`PORT_RANGE` nobody listens on right now."""
    ports: list[int] = []
    while len(ports) < count:
        port = secrets.randbelow(PORT_RANGE[1] - PORT_RANGE[0]) + PORT_RANGE[0]
        if port in ports:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


class SlurmCluster:
    """munged + slurmctld + one slurmd per node of :data:`NODES`, all on 127.0.0.1."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []
        self.conf = root / "slurm.conf"
        # A name of its own: processes are matched to this cluster's jobs by it (job ids
        # start at 1 in every cluster).
        self.name = f"podium{secrets.token_hex(4)}"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def _write_config(self) -> None:
        root = self.root
        for sub in ("munge", "state", "spool", "log"):
            (root / sub).mkdir(mode=0o700, exist_ok=True)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        ctld_port, *node_ports = _free_ports(1 + len(NODES))
        nodes = "\n".join(f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} "
                          f"CPUs={NODE_CPUS} State=UNKNOWN" for n, port in zip(NODES, node_ports))
        self.conf.write_text(f"""\
ClusterName={self.name}
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=30
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the daemon holds it
        self.procs.append(subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL,
                                           stdout=log, stderr=subprocess.STDOUT))
        log.close()

    def start(self) -> SlurmCluster:
        """Start the daemons and wait (deadline) until every node is idle; a daemon that
        finds its port taken after all (another program bound it since the draw) gets the
        whole cluster restarted on fresh ports, up to :data:`START_TRIES` times."""
        for _ in range(START_TRIES - 1):
            try:
                return self._start_once()
            except RuntimeError as exc:
                if "Address already in use" not in str(exc):
                    raise
            self.stop()
            self.procs.clear()
            for sub in ("munge", "state", "spool", "log"):  # a clean start, logs included
                shutil.rmtree(self.root / sub, ignore_errors=True)
        return self._start_once()

    def _start_once(self) -> SlurmCluster:
        self._write_config()
        m = self.root / "munge"
        self._spawn("munged", ["munged", "--foreground", "--force", f"--key-file={m}/munge.key",
                               f"--socket={m}/munge.socket", f"--pid-file={m}/munged.pid",
                               f"--seed-file={m}/munged.seed", f"--log-file={m}/munged.log"])
        self._until(lambda: (m / "munge.socket").exists(), "munged to create its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in NODES:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
        self._until(self._all_idle, "the nodes to be idle")
        return self

    def _all_idle(self) -> bool:
        states = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split("\n")
        idle = {line.split()[0] for line in states if line.strip().endswith(" idle")}
        return idle == set(NODES)

    def _until(self, ready, what: str, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} waiting for {what}:\n"
                                       + self.logs())
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}:\n" + self.logs())
            time.sleep(0.2)

    def run(self, argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (30 s deadline)."""
        return subprocess.run(argv, env={**self.env, **kw.pop("env", {})}, capture_output=True,
                              text=True, timeout=30, check=check, **kw)

    def job_state(self, job_id: str) -> str:
        """squeue's state of a job ("" once it has left the queue)."""
        return self.run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False).stdout.strip()

    def logs(self) -> str:
        """The tail of every daemon log, for failure messages."""
        out = []
        for path in sorted((self.root / "log").glob("*")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(out)

    def stop(self) -> None:
        """Cancel every job (a job's slurmstepd outlives slurmd), wait until their processes
        are gone, then SIGTERM the daemons we started (slurmd first), SIGKILL after 15 s."""
        if self.procs and self.procs[1:2] and self.procs[1].poll() is None:  # slurmctld runs
            self.run(["scancel", "--quiet", f"--user={os.geteuid()}"], check=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (
                    self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip()
                    or job_processes(self.name)):
                time.sleep(0.5)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        # Last resort when the daemons could not cancel them: the jobs' processes are ours.
        for line in job_processes(self.name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)


def job_processes(cluster: str, job_id: str | None = None) -> list[str]:
    """"pid cmdline" of every process whose environment says it belongs to Slurm job
    ``job_id`` (any job when None) of the cluster named ``cluster``."""
    markers = [f"SLURM_CLUSTER_NAME={cluster}".encode()]
    if job_id is not None:
        markers.append(f"SLURM_JOB_ID={job_id}".encode())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if all(marker in environ for marker in markers):
            found.append(f"{entry.name} {cmdline[:160]}")
    return found
