"""``podium slurm``: a Podium cluster for one controller script, inside a Slurm allocation.

    #SBATCH --nodes=2 --gres=gpu:8 --exclusive
    podium slurm -- python train.py --epochs 3          # in the batch script

On the job's first node (where the batch script runs) it

1. makes a job directory (default ``~/.podium/slurm/<job id>``, mode 0700) holding a fresh
   cluster token (``token``, mode 0600) and the logs;
2. starts ``podium scheduler`` on the address this node is reached at (any free ports,
   state in memory: the cluster lives as long as the job);
3. starts one node agent per node with ``srun --overlap --ntasks-per-node=1``
   (:mod:`podium.cli.slurmnode`): each offers the GPUs Slurm gave the job on its node
   (``CUDA_VISIBLE_DEVICES``; none if it has none, unless ``--all-gpus``), the token
   reaches it in srun's environment, never argv;
4. waits (``--register-timeout``) until every node has registered;
5. runs the command with ``PODIUM_ADDRESS``, ``PODIUM_TOKEN`` and ``PODIUM_TOKEN_FILE`` set;
6. when the command ends, or on SIGTERM/SIGINT (``scancel``, the time limit), stops the
   command, the agents (which stop their workers), then the scheduler, each with SIGKILL
   after ``--stop-grace``, and removes the token. Its exit status is the command's
   (143 when cancelled).

Every process it starts stays in the batch step's process group, so Slurm's own
process tracking (cgroup, linuxproc or pgid) reaps whatever a kill -9 leaves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from podium import errors
from podium.private import PRIVATE_DIR, given_dir, open_private, private_dir, read_port_file

__all__ = ["main", "build_parser", "job_from_env", "SlurmJob"]

#: Bounds on what a user can set (seconds).
MAX_TIMEOUT = 3600.0
MAX_GRACE = 300.0


class Cancelled(Exception):
    """SIGTERM/SIGINT arrived: tear down and exit (128 + the signal, as a shell reports it)."""


class SlurmJob:
    """What the launcher reads from the allocation's environment."""

    def __init__(self, job_id: str, nodes: int, node_name: str) -> None:
        self.job_id = job_id
        self.nodes = nodes
        self.node_name = node_name


def job_from_env(env: dict[str, str]) -> SlurmJob:
    """The allocation this process runs in (FailedPreconditionError outside one)."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        raise errors.FailedPreconditionError(
            "not inside a Slurm allocation (no SLURM_JOB_ID): run it from an sbatch script or salloc")
    raw = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise errors.InvalidArgumentError(f"SLURM_JOB_NUM_NODES={raw!r} is not a node count")
    return SlurmJob(job_id, int(raw), env.get("SLURMD_NODENAME") or socket.gethostname())


def build_parser() -> argparse.ArgumentParser:
    """The ``podium slurm`` command line."""
    p = argparse.ArgumentParser(
        prog="podium slurm", description="Inside a Slurm allocation: start a Podium cluster on its "
        "nodes, run COMMAND against it, stop everything when COMMAND ends or the job is cancelled.",
        usage="podium slurm [options] -- COMMAND [ARG ...]")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the controller, e.g. python train.py")
    p.add_argument("--job-dir", default=None,
                   help="token and logs (default ~/.podium/slurm/<job id>; on a shared filesystem "
                        "the workers' logs of every node land there too)")
    p.add_argument("--scheduler-host", default=None,
                   help="address the nodes reach this node at (default: this host name's address)")
    p.add_argument("--port", type=int, default=0, help="scheduler gRPC port (0: any free)")
    p.add_argument("--http-port", type=int, default=0, help="scheduler HTTP port (0: any free)")
    p.add_argument("--cpus-per-node", type=float, default=None,
                   help="CPU slots each node offers (default: max(Slurm's CPUs, 16 per GPU))")
    p.add_argument("--fake-gpus", type=int, default=None,
                   help="pretend each node has N GPUs (CPU-only clusters, trying it out)")
    p.add_argument("--all-gpus", action="store_true",
                   help="offer every GPU of each node when Slurm names none (clusters without "
                        "gres/gpu that give whole nodes; default: only the job's GPUs)")
    p.add_argument("--register-timeout", type=float, default=180.0,
                   help="seconds to wait for every node to register (180)")
    p.add_argument("--stop-grace", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping (10)")
    p.add_argument("--srun-arg", action="append", default=[], metavar="ARG",
                   help="extra srun argument for the agent step (repeatable), e.g. --srun-arg=--mpi=none")
    return p


def _check(args: argparse.Namespace) -> list[str]:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise errors.InvalidArgumentError("give the controller command after --, e.g. "
                                          "podium slurm -- python train.py")
    for name in ("register_timeout", "stop_grace"):
        value, bound = getattr(args, name), MAX_TIMEOUT if name == "register_timeout" else MAX_GRACE
        if not 0 < value <= bound:
            raise errors.InvalidArgumentError(f"--{name.replace('_', '-')} must be in (0, {bound:g}], got {value}")
    for name in ("port", "http_port"):
        if not 0 <= getattr(args, name) < 65536:
            raise errors.InvalidArgumentError(f"--{name.replace('_', '-')} must be a port, got {getattr(args, name)}")
    if args.fake_gpus is not None and not 0 <= args.fake_gpus <= 1024:
        raise errors.InvalidArgumentError(f"--fake-gpus must be in [0, 1024], got {args.fake_gpus}")
    if args.cpus_per_node is not None and not args.cpus_per_node > 0:
        raise errors.InvalidArgumentError(f"--cpus-per-node must be > 0, got {args.cpus_per_node}")
    return command


def _say(text: str) -> None:
    print(f"podium slurm: {text}", file=sys.stderr, flush=True)


class Launcher:
    """The processes of one job's cluster and their orderly end."""

    def __init__(self, args: argparse.Namespace, job: SlurmJob, command: list[str]) -> None:
        self.args, self.job, self.command = args, job, command
        self.cancel = threading.Event()
        #: The signal that set ``cancel``.
        self.signal = signal.SIGTERM
        self.dir = pathlib.Path(args.job_dir or f"~/.podium/slurm/{job.job_id}").expanduser().resolve()
        self.token = secrets.token_urlsafe(32)
        self.token_file = self.dir / "token"
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    def _wait(self, what: str, deadline: float, ready: Callable[[], Any]) -> Any:
        """Poll ``ready()`` until it returns something, the deadline passes, a process we
        started exits, or a signal arrives."""
        while True:
            if self.cancel.is_set():
                raise Cancelled()
            value = ready()
            if value is not None:
                return value
            for role, proc in self.procs.items():
                if proc.poll() is not None:
                    raise errors.UnavailableError(
                        f"{role} exited with code {proc.returncode} while waiting for {what} "
                        f"(logs in {self.dir / 'logs'})")
            if time.monotonic() > deadline:
                raise errors.DeadlineExceededError(f"{what}: not done within {self.args.register_timeout:g} s "
                                                   f"(logs in {self.dir / 'logs'})")
            time.sleep(0.2)

    def _spawn(self, role: str, argv: list[str], env: dict[str, str], log_name: str | None) -> None:
        out = None
        if log_name:
            out = open_private(self.dir / "logs" / log_name, "ab")  # closed in stop()
            self._logs.append(out)
        # No new session: the process stays in the batch step's group, where Slurm finds it.
        self.procs[role] = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT if out else None, close_fds=True)

    def start(self) -> str:
        """Token, scheduler, agents; returns the scheduler address once every node registered."""
        if self.args.job_dir:  # a folder given, not made here: no other user may plant files in it (#48)
            given_dir(self.dir, "podium slurm --job-dir")
        private_dir(self.dir / "logs")  # 0700 both, whatever the umask
        os.chmod(self.dir, PRIVATE_DIR)
        self.token_file.unlink(missing_ok=True)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(self.token + "\n")
        env = {k: v for k, v in os.environ.items() if k != "PODIUM_TOKEN_FILE"}
        env.update(PODIUM_TOKEN=self.token, PYTHONUNBUFFERED="1")
        try:
            host = self.args.scheduler_host or socket.gethostbyname(socket.gethostname())
        except OSError as exc:
            raise errors.FailedPreconditionError(
                f"cannot resolve this host's name {socket.gethostname()!r} ({exc}): "
                f"give --scheduler-host ADDRESS") from None
        if not self.args.scheduler_host and host.startswith("127.") and self.job.nodes > 1:
            raise errors.FailedPreconditionError(
                f"this host's name resolves to {host}, which other nodes cannot reach: "
                f"give --scheduler-host ADDRESS (this node's address on the cluster network)")
        deadline = time.monotonic() + self.args.register_timeout
        port_file = self.dir / "scheduler.port.json"
        port_file.unlink(missing_ok=True)
        self._spawn("scheduler", [sys.executable, "-m", "podium.cli", "scheduler", "--host", host,
                                  "--port", str(self.args.port), "--http-port", str(self.args.http_port),
                                  "--state", ":memory:", "--port-file", str(port_file)],
                    env, "scheduler.log")

        def ports():
            return read_port_file(port_file, self.procs["scheduler"].pid)  # only the file it wrote

        info = self._wait("the scheduler to serve", deadline, ports)
        address, http = f"{host}:{info['port']}", f"http://{host}:{info['http_port']}"
        _say(f"scheduler at {address} (HTTP {http}); starting {self.job.nodes} node agents")
        n = str(self.job.nodes)
        agent = [sys.executable, "-m", "podium.cli.slurmnode", "--scheduler", address,
                 "--log-dir", str(self.dir / "workers"), "--stop-grace", str(min(self.args.stop_grace, 30.0))]
        if self.args.fake_gpus is not None:
            agent += ["--fake-gpus", str(self.args.fake_gpus)]
        if self.args.all_gpus:
            agent.append("--all-gpus")
        if self.args.cpus_per_node is not None:
            agent += ["--cpus", str(self.args.cpus_per_node)]
        self._spawn("node agents (srun)", ["srun", "--overlap", f"--nodes={n}", f"--ntasks={n}",
                                           "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                                           f"--job-name=podium-agents-{self.job.job_id}",
                                           *self.args.srun_arg, *agent], env, "agents.log")
        request = urllib.request.Request(f"{http}/v1/nodes", headers={"Authorization": f"Bearer {self.token}"})

        def registered():
            with contextlib.suppress(OSError, ValueError, KeyError):
                with urllib.request.urlopen(request, timeout=5) as reply:
                    nodes = json.loads(reply.read())["nodes"]
                if sum(1 for node in nodes if node.get("state") == "NODE_ALIVE") >= self.job.nodes:
                    return True
            return None

        self._wait(f"{self.job.nodes} node agents to register", deadline, registered)
        _say(f"{self.job.nodes} nodes registered; running {' '.join(self.command)}")
        return address

    def run(self, address: str) -> int:
        """Run the controller command; its exit status (Cancelled on a signal)."""
        env = dict(os.environ, PODIUM_ADDRESS=address, PODIUM_TOKEN=self.token,
                   PODIUM_TOKEN_FILE=str(self.token_file), PODIUM_SLURM_JOB_DIR=str(self.dir))
        try:
            self._spawn("controller", self.command, env, None)
        except OSError as exc:
            raise errors.InvalidArgumentError(f"cannot run {self.command[0]!r}: {exc.strerror or exc}") from None
        proc = self.procs["controller"]
        while True:
            if self.cancel.is_set():
                raise Cancelled()
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(0.2)
                if self.cancel.is_set():  # scancel signals the controller too: it may end first
                    raise Cancelled()
                return 128 - code if code < 0 else code  # killed by signal N: 128+N, as a shell says

    def stop(self) -> None:
        """Controller, agents, scheduler: SIGTERM, then SIGKILL after the grace period."""
        order = ["controller", "node agents (srun)", "scheduler"]
        for role in order:
            proc = self.procs.get(role)
            if proc is None or proc.poll() is not None:
                continue
            _say(f"stopping {role}")
            # srun forwards SIGUSR2 to the agents as it is (they stop their workers, then
            # exit); a SIGTERM it would turn into SIGKILL for every task.
            first = signal.SIGUSR2 if role.endswith("(srun)") else signal.SIGTERM
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(first)
            try:
                proc.wait(self.args.stop_grace)
            except subprocess.TimeoutExpired:
                _say(f"{role} still runs after {self.args.stop_grace:g} s: SIGKILL")
                # srun passes SIGKILL on to the step's tasks when it gets SIGTERM.
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM if first == signal.SIGUSR2 else signal.SIGKILL)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(10)
        for handle in self._logs:
            handle.close()
        self.token_file.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """``podium slurm [options] -- COMMAND``; returns COMMAND's exit status."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        command = _check(args)
        job = job_from_env(dict(os.environ))
    except errors.PodiumError as exc:
        print(f"podium slurm: {exc}", file=sys.stderr)
        return 2
    launcher = Launcher(args, job, command)

    def on_signal(signum, _frame):
        # No printing here: a handler that writes can interrupt a write to the same stream.
        launcher.signal = signum
        launcher.cancel.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    status = 1
    try:
        status = launcher.run(launcher.start())
        _say(f"{' '.join(command)} exited with code {status}")
    except Cancelled:
        _say(f"got {signal.Signals(launcher.signal).name}: stopping")
        status = 128 + launcher.signal
    except (errors.PodiumError, OSError) as exc:  # OSError: the job directory, a log file
        _say(str(exc))
    finally:
        launcher.stop()
    return status
