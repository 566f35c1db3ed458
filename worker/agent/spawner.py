"""Worker processes of one node: start them, watch them become ready, reap them, stop them.

Bootstrap contract with ``podium.worker.host.process`` (keep both sides exactly alike):
the agent runs ``[sys.executable, "-m", "podium.worker.host", "--ready-fd", W]``
where ``W`` is the write end of a pipe passed with ``pass_fds``; cwd is the agent's
cwd; env is the agent's environment (minus ``PODIUM_TOKEN_FILE``) plus
``WorkerInfo.env`` plus ``PODIUM_TOKEN``/``PODIUM_SCHEDULER`` (and
``PODIUM_WORKER_ID``/``PODIUM_NODE_ADDRESS``) when absent, the agent's own TLS file
paths as ``PODIUM_TLS_CERT``/``PODIUM_TLS_KEY``/``PODIUM_TLS_CA`` (never inherited),
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``PYTHONUNBUFFERED=1`` (see :func:`worker_env`); a group's master
also inherits MASTER_PORT's listening socket, its fd in ``PODIUM_MASTER_LISTEN_FD``
(podium.worker.masterstore). Once it serves, the worker writes exactly one JSON line
``{"port": 12345}`` to ``W`` and closes it. A pipe closed without that line, or a
process that exits first, makes the worker FAILED.

Each worker runs in its own session (``start_new_session``), so its pid is also
its process group id and ``killpg`` reaches the whole tree it started.

Forked workers (the default) outlive a SIGKILLed agent in its fork server, which hands
them to the next agent of the node (:meth:`Spawner.adopt`) or kills them at the node's
fence deadline (docs/architecture.md, "An agent restarted mid-job"). An exec'd worker dies
with the agent: the command runs behind podium.process's exec shim, which sets
``PR_SET_PDEATHSIG`` to SIGKILL (same pid, the exact argv above; see that module for why not
a preexec_fn).
The death signal fires when the *thread* that spawned the child ends, so
spawning happens on the event loop thread, which lives as long as the agent.
Grandchildren a worker starts are not covered; the worker's process group is
killed whenever the worker ends, which catches them in every other case.

Reaping uses a pidfd per child watched by the event loop: the loop wakes the
moment a child dies, so EXITED is reported within milliseconds, with the exit
code or signal and the last lines of its stderr file.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from podium.private import private_dir
from podium.process import kernel_state, start_time
from podium.resources import check_env_entries
from podium.transport import shm
from podium.worker.agent import forkserver
from podium.auth import TlsConfig
from podium.errors import InvalidArgumentError, NotFoundError, UnavailableError
from podium.v1 import common_pb2, node_pb2, scheduler_pb2
from podium.worker.agent.exitinfo import exit_info
from podium.worker.agent.adoption import adopted_worker, record_of
from podium.worker.agent.managed import ManagedWorker, parse_ready, ready_cap
from podium.runtimeenv import check_spec
from podium.worker.masterstore import LISTEN_FD_ENV
from podium.worker.agent.workerenv import (ALLOCATOR_DEFAULTS, launch_argv, launch_plan, runtime_env_vars,
                                           with_allocator_defaults, worker_env)

log = logging.getLogger(__name__)

#: How long a spawn waits for the fork server to finish its imports before it starts
#: workers as new processes instead. Right after the agent starts the helper is still
#: importing torch; waiting for it costs at most the rest of that one import, while each
#: exec'd worker pays all of it again (and its first DataProto call took ~3 s more on
#: 2 cores, importing torch and tensordict then).
FORKSERVER_READY_SECONDS = 10.0

#: The command that starts a worker process; ``--ready-fd N`` is appended.
DEFAULT_WORKER_COMMAND: tuple[str, ...] = (sys.executable, "-m", "podium.worker.host")

#: Longest we wait for a process to die after SIGKILL before giving up on it.
_KILL_WAIT_SECONDS = 5.0

#: How long a worker that closed its ready pipe without a port may take to exit on its own.
_EOF_EXIT_WAIT_SECONDS = 1.0

#: Ended workers remembered (for ListWorkers and TailLog); older ones are forgotten.
MAX_ENDED_WORKERS = 1000


_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,199}$")

Reporter = Callable[[scheduler_pb2.ReportWorkerRequest], None]


class Spawner:
    """Starts, watches, reaps and stops the worker processes of one node.

    Every state change goes to ``report`` (a non-blocking callable the agent
    forwards to the scheduler's ReportWorker). All methods run on the event
    loop thread.
    """

    def __init__(self, *, log_dir: str | os.PathLike, node_id: str, node_address: str,
                 scheduler: str, token: str, report: Reporter,
                 command: Sequence[str] | None = None, stop_grace: float = 5.0,
                 base_env: Mapping[str, str] | None = None, tls: TlsConfig | None = None) -> None:
        self.log_dir = pathlib.Path(log_dir)
        private_dir(self.log_dir)  # 0700, and each log 0600: a worker's output is its own
        self.node_id = node_id
        self.node_address = node_address
        self.scheduler = scheduler
        self.token = token
        #: The agent's mutual TLS; its workers serve and call peers with the same files.
        self.tls = tls
        self.command = tuple(command or DEFAULT_WORKER_COMMAND)
        self.stop_grace = stop_grace
        self._report = report
        # Workers' allocator defaults (THP for torch's large CPU buffers) unless this
        # environment sets them: see workerenv.ALLOCATOR_DEFAULTS.
        self._base_env = with_allocator_defaults(os.environ if base_env is None else base_env)
        self._workers: dict[str, ManagedWorker] = {}
        # The ended ones among them, oldest end first: forgetting the oldest is O(1) per exit
        # (a scan of every worker per exit made a node's shutdown O(N^2)).
        self._ended: collections.OrderedDict[str, ManagedWorker] = collections.OrderedDict()
        self._closed = False
        #: The fork server (podium.worker.agent.forkserver) that starts default-command workers
        #: without an interpreter start-up each; None until started or where not used.
        self._forkserver: forkserver.ForkServer | None = None
        self._fork = self.command == DEFAULT_WORKER_COMMAND and forkserver.enabled(self._base_env)
        with contextlib.suppress(RuntimeError):  # no loop yet: started by the first spawn
            asyncio.get_running_loop()
            self._start_forkserver()

    def _start_forkserver(self) -> None:
        if not self._fork or self._forkserver is not None:
            return
        server = forkserver.ForkServer(self._base_env, self.log_dir / "forkserver.log",
                                       listen=self.log_dir / forkserver.LISTEN_NAME)
        try:
            server.start()
        except OSError as exc:
            log.warning("fork server did not start (%s); workers start as new processes", exc)
            self._fork = False
            return
        self._forkserver = server

    async def adopt(self, timeout: float = 10.0) -> int:
        """Take over the workers a previous agent of this node left with its fork server
        (:mod:`podium.worker.agent.adoption`); how many live ones were adopted. Call before
        the node registers, so the scheduler hears of them as running."""
        self._start_forkserver()
        server = self._forkserver
        if server is None or not server.adopted or not await server.wait_ready(timeout):
            return 0
        adopted = 0
        for entry in server.adoptable:
            worker, proc = adopted_worker(entry), server.adopt(int(entry["pid"]))
            if worker is None:
                # Still starting when the agent died (no record): nobody can reach it, so it
                # goes. Never a pid whose start time says it is some other process now.
                pid = int(entry["pid"])
                if entry.get("meta") is None and "code" not in entry and start_time(pid) == entry.get("start"):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                continue
            self._workers[worker.id] = worker
            worker.proc = proc
            if not worker.exited.done():
                adopted += 1
                worker.watch_exit(proc)
            worker.task = asyncio.get_running_loop().create_task(self._supervise(worker),
                                                                 name=f"supervise-{worker.id}")
        log.info("re-adopted %d running worker(s) from fork server %d", adopted, server.pid)
        return adopted

    def note_fence_deadline(self, deadline: float) -> None:
        """Tell the fork server by when to kill the workers if this agent dies (the link's
        fence deadline, ``time.monotonic()``)."""
        if self._forkserver is not None:
            self._forkserver.notify({"fence_at": deadline})

    @property
    def inherited_fence_at(self) -> float | None:
        """The fence deadline the previous agent left with the adopted workers, or None."""
        return self._forkserver.inherited_fence_at if self._forkserver is not None else None

    # ------------------------------------------------------------ queries

    def get(self, worker_id: str) -> ManagedWorker:
        """The worker with that id; NotFoundError when this agent never started it."""
        try:
            return self._workers[worker_id]
        except KeyError:
            raise NotFoundError(f"no worker {worker_id!r} on node {self.node_id}",
                                node=self.node_id) from None

    def workers(self) -> list[ManagedWorker]:
        """Every worker this agent started, alive or not, in start order."""
        return list(self._workers.values())

    def running(self) -> list[scheduler_pb2.RunningWorker]:
        """The workers whose process is alive (for RegisterNode and Heartbeat)."""
        return [scheduler_pb2.RunningWorker(worker_id=w.id, pid=w.pid, port=w.port,
                                            gpu_memory_cap=w.gpu_memory_cap)
                for w in self._workers.values() if w.alive]

    def worker_of_pid(self, pid: int) -> str:
        """Id of the worker whose process tree ``pid`` belongs to, or ""."""
        by_pid = {w.pid: w.id for w in self._workers.values() if w.alive}
        if pid in by_pid:
            return by_pid[pid]
        try:
            # Workers lead their own process group, so a helper process they
            # started (a CUDA-using subprocess) maps back through its pgid.
            return by_pid.get(os.getpgid(pid), "")
        except OSError:
            return ""

    # ------------------------------------------------------------ spawning

    def validate(self, workers: Sequence[common_pb2.WorkerInfo]) -> None:
        """InvalidArgumentError unless every worker id is usable and unique in the request."""
        seen = set()
        for info in workers:
            if not _SAFE_ID.match(info.id):
                raise InvalidArgumentError(
                    f"bad worker id {info.id!r}: letters, digits and ._:@+=- only (it names log files)")
            if info.id in seen:
                raise InvalidArgumentError(f"worker id {info.id!r} appears twice in one request")
            seen.add(info.id)
            check_env_entries(info.env, f"worker {info.id}: env")
            check_spec(info.spec, f"worker {info.id}")

    async def spawn(self, workers: Sequence[common_pb2.WorkerInfo],
                    listen: Mapping[str, int] | None = None) -> list[node_pb2.SpawnedWorker]:
        """Start one process per WorkerInfo; returns at once with their pids. ``listen``:
        worker id -> a listening socket's fd that worker inherits (module docstring).

        Readiness is reported later (RUNNING or FAILED). A worker id whose
        process is alive is not started again (a retried request is harmless);
        one whose process ended is started afresh (its logs are appended to).
        Validation happens before anything starts. Once :meth:`stop_all` ran
        (agent shutdown), every spawn is UnavailableError.
        """
        self.validate(workers)
        if self._closed:
            raise UnavailableError(f"node {self.node_id} is shutting down", node=self.node_id)
        self._start_forkserver()
        fork = (self._forkserver is not None
                and await self._forkserver.wait_ready(FORKSERVER_READY_SECONDS))
        started: list[ManagedWorker | asyncio.Future[ManagedWorker]] = []
        for info in workers:
            known = self._workers.get(info.id)
            if known is None or known.ended:
                self._workers.pop(info.id, None)  # re-insert: start order stays true
                self._ended.pop(info.id, None)
                # Forks are requested back to back (tasks) and answered by the helper in order.
                fd = (listen or {}).get(info.id, -1)
                started.append(asyncio.ensure_future(self._start_forked(info, fd)) if fork and self._forkable(info)
                               else self._start(info, fd))
            else:
                started.append(known)
        out = []
        for item in started:
            done = item if isinstance(item, ManagedWorker) else await item
            out.append(node_pb2.SpawnedWorker(worker_id=done.id, pid=done.pid,
                                              log_path=str(done.out_path)))
        return out

    def _forkable(self, info: common_pb2.WorkerInfo) -> bool:
        """Whether a child of the fork server starts as ``info``'s environment asks: torch in
        the fork server has read its allocator setting (ALLOCATOR_DEFAULTS) once and for all,
        so a worker that wants another one starts as a new process."""
        spec = info.spec  # a runtime_env (its interpreter, sys.path, cwd) needs a fresh process
        return (not (spec.python_command or spec.working_dir or spec.py_modules or spec.pip.packages)
                and all(info.env.get(key, self._base_env[key]) == self._base_env[key] for key in ALLOCATOR_DEFAULTS))

    def _new_worker(self, info: common_pb2.WorkerInfo) -> tuple["ManagedWorker", dict[str, str]]:
        """Record a worker about to start, and the environment it starts with."""
        worker = ManagedWorker(info, self.log_dir / f"{info.id}.out", self.log_dir / f"{info.id}.err")
        self._workers[info.id] = worker
        env = worker_env(self._base_env, info.env, token=self.token, scheduler=self.scheduler,
                         worker_id=info.id, node_address=self.node_address, tls=self.tls)
        env["PODIUM_SPAWN_REQUESTED_AT"] = repr(time.time())  # start-up phases (bench)
        env.update(runtime_env_vars(env, info.spec, ""))  # what its own actors inherit
        return worker, env

    def _launch(self, info: common_pb2.WorkerInfo, env: dict[str, str]) -> tuple[tuple[str, ...], str]:
        """The command and cwd that start ``info`` as a new process, with ``env`` completed for
        its runtime_env (podium.runtimeenv, workerenv.launch_plan); FileNotFoundError when its
        working_dir or a py_module is not on this node."""
        return launch_plan(info.spec, env, self.command, self.log_dir)

    async def _start_forked(self, info: common_pb2.WorkerInfo, listen_fd: int = -1) -> ManagedWorker:
        """Like :meth:`_start`, through the fork server (falls back to :meth:`_start`)."""
        server = self._forkserver
        if server is None:  # only forks once the fork server is up (spawn)
            return self._start(info, listen_fd)
        worker, env = self._new_worker(info)
        read_fd, write_fd = os.pipe()
        try:
            with worker.log_files(self.node_id) as (out, err):
                fds = (write_fd, out.fileno(), err.fileno(), *([listen_fd] if listen_fd >= 0 else []))
                forked = await server.spawn(env, os.getcwd(), fds, [self.command[-1]])
                worker.proc = forked
            os.close(write_fd)  # the helper got its own copies with the request
            write_fd = -1
        except Exception as exc:  # noqa: BLE001 - any failure: the exec path decides (and reports)
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
            log.warning("worker %s: fork server failed (%s); starting it as a new process", info.id, exc)
            self._workers.pop(info.id, None)
            return self._start(info, listen_fd)
        return self._running(worker, forked, read_fd, "forked")

    def _start(self, info: common_pb2.WorkerInfo, listen_fd: int = -1) -> ManagedWorker:
        worker, env = self._new_worker(info)
        if listen_fd >= 0:
            env[LISTEN_FD_ENV] = str(listen_fd)  # pass_fds keeps its number
        read_fd, write_fd = os.pipe()
        try:
            with worker.log_files(self.node_id) as (out, err):
                command, cwd = self._launch(info, env)
                # No preexec_fn, so Popen can vfork (see the module docstring).
                proc = worker.proc = subprocess.Popen(
                    launch_argv(command, write_fd), pass_fds=(write_fd, *([listen_fd] if listen_fd >= 0 else [])),
                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=cwd, env=env,
                    start_new_session=True)
        except Exception as exc:  # noqa: BLE001 - OSError, ValueError (a NUL in env), ...
            # Whatever the OS refused, the worker ends FAILED with the reason (reported), so
            # no STARTING ghost stays and a retried spawn of this id starts afresh.
            os.close(read_fd)
            worker.state = common_pb2.WORKER_FAILED
            worker.exit = common_pb2.ExitInfo(exit_code=-1,
                                              reason=f"spawn failed: {type(exc).__name__}: {exc}")
            worker.exited.set_result(-1)
            worker.ready.set_result(b"")
            log.error("worker %s: spawn failed: %s", info.id, exc)
            self._send(worker)
            return worker
        finally:
            os.close(write_fd)
        return self._running(worker, proc, read_fd, "started")

    def _running(self, worker: ManagedWorker, proc: subprocess.Popen | forkserver.ForkedProcess,
                 read_fd: int, how: str) -> ManagedWorker:
        """Watch a worker whose process ``proc`` exists: its exit, its ready pipe, its supervision."""
        worker.pid = proc.pid
        log.info("worker %s (%s) %s, pid %d", worker.id, worker.info.spec.name, how, worker.pid)
        worker.watch_exit(proc)
        worker.watch_ready(read_fd)
        worker.task = asyncio.get_running_loop().create_task(self._supervise(worker),
                                                             name=f"supervise-{worker.id}")
        return worker

    async def _supervise(self, worker: ManagedWorker) -> None:
        either: set[asyncio.Future[Any]] = {worker.ready, worker.exited}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        port, problem, killed = 0, "", False
        if worker.ready.done():
            port, problem = parse_ready(worker.ready.result())
            worker.gpu_memory_cap = ready_cap(worker.ready.result()) if port else None
        if port and not worker.stop_requested:
            worker.port = port
            worker.state = common_pb2.WORKER_RUNNING
            log.info("worker %s ready on port %d", worker.id, port)
            self._send(worker)
            if self._forkserver is not None and isinstance(worker.proc, forkserver.ForkedProcess):
                self._forkserver.notify({"record": worker.pid, "meta": record_of(worker)})
        elif not port and not worker.exited.done():
            # The pipe closes a moment before the exit is reaped; give a dying
            # process that moment so its own exit code is what we report.
            await asyncio.wait({worker.exited}, timeout=_EOF_EXIT_WAIT_SECONDS)
            if not worker.exited.done():
                # Closed its ready pipe without a usable line but still runs: it
                # is broken and nobody can reach it. End it rather than leak it.
                log.warning("worker %s: %s; killing it", worker.id, problem)
                self._kill_group(worker, signal.SIGKILL)
                killed = True
        returncode = await worker.exited
        if not worker.ready.done():
            # A helper process inherited the pipe's write end; stop listening.
            worker.close_ready()
        if not killed and not worker.ready.result().strip():
            problem = ""  # no line at all because it died: its exit says why
        self._kill_group(worker, signal.SIGKILL)  # helpers it left behind
        # Shared-memory segments it wrote and no reader mapped (it died mid-transfer).
        removed = shm.remove_segments_of(worker.pid)
        if removed:
            log.info("worker %s: removed %d shared-memory segment(s) it left", worker.id, len(removed))
        requested = worker.stop_requested
        if worker.state == common_pb2.WORKER_RUNNING or requested:
            worker.state = common_pb2.WORKER_EXITED
            worker.exit = exit_info(returncode, worker.err_path, requested=requested)
        else:
            worker.state = common_pb2.WORKER_FAILED
            worker.exit = exit_info(returncode, worker.err_path,
                                    reason=problem or "exited before it was ready")
        log.info("worker %s %s: %s", worker.id, common_pb2.WorkerState.Name(worker.state),
                 worker.exit.reason)
        self._send(worker)
        self._forget_old(worker)

    def _forget_old(self, worker: ManagedWorker) -> None:
        """``worker`` ended: remember it, and forget the ended workers beyond
        MAX_ENDED_WORKERS, those that ended first."""
        if self._workers.get(worker.id) is worker:
            self._ended[worker.id] = worker
            self._ended.move_to_end(worker.id)
        while len(self._ended) > MAX_ENDED_WORKERS:
            worker_id, old = self._ended.popitem(last=False)
            if self._workers.get(worker_id) is old:
                del self._workers[worker_id]

    def _send(self, worker: ManagedWorker) -> None:
        request = scheduler_pb2.ReportWorkerRequest(worker_id=worker.id, state=worker.state,
                                                    pid=worker.pid, port=worker.port,
                                                    node_id=self.node_id,
                                                    gpu_memory_cap=worker.gpu_memory_cap)
        if worker.exit is not None:
            request.exit.CopyFrom(worker.exit)
        try:
            self._report(request)
        except Exception:  # noqa: BLE001 - a broken reporter must not stop reaping
            log.exception("reporting worker %s failed", worker.id)

    # ------------------------------------------------------------ stopping

    def _kill_group(self, worker: ManagedWorker, sig: int) -> None:
        if worker.pid <= 0:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, sig)

    async def stop(self, worker_ids: Iterable[str], grace: float = 0.0) -> int:
        """SIGTERM each worker's process group, SIGKILL what is left after ``grace``
        seconds (0: the spawner's default), and wait until they are reaped.

        Unknown ids raise NotFoundError before anything is stopped. Returns how many
        were alive. Their exit is reported EXITED with ``requested``.
        """
        workers = [self.get(worker_id) for worker_id in worker_ids]
        return await self._stop(workers, grace)

    def fence(self) -> int:
        """SIGKILL every live worker now, with no grace (the node could not renew its lease:
        :mod:`podium.worker.agent.link`); how many were alive. Exits are reported as reaped."""
        alive = [w for w in self.workers() if w.alive]
        for worker in alive:
            worker.stop_requested = True
            self._kill_group(worker, signal.SIGKILL)
        return len(alive)

    async def stop_all(self, grace: float = 0.0) -> int:
        """Stop every live worker and refuse new ones from now on (agent shutdown)."""
        self._closed = True
        stopped = await self._stop(self.workers(), grace)
        if self._forkserver is not None:
            await self._forkserver.close()
        return stopped

    async def _stop(self, workers: list[ManagedWorker], grace: float) -> int:
        grace = grace if grace > 0 else self.stop_grace
        alive = [w for w in workers if w.alive]
        for worker in alive:
            worker.stop_requested = True
            if worker.state in (common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING):
                worker.state = common_pb2.WORKER_STOPPING
            self._kill_group(worker, signal.SIGTERM)
            if kernel_state(worker.pid)[0] in ("T", "t"):
                # SIGTERM waits for a SIGCONT, which would let it answer again: the grace gains nothing.
                self._kill_group(worker, signal.SIGKILL)
        if not alive:
            return 0
        await asyncio.wait([w.exited for w in alive], timeout=grace)
        for worker in alive:
            if not worker.exited.done():
                log.info("worker %s ignored SIGTERM for %.1f s; sending SIGKILL", worker.id, grace)
                self._kill_group(worker, signal.SIGKILL)
        _, pending = await asyncio.wait([w.exited for w in alive], timeout=_KILL_WAIT_SECONDS)
        for worker in alive:
            if worker in pending:
                log.error("worker %s (pid %d) survived SIGKILL", worker.id, worker.pid)
        # Let the supervisors write their reports before the caller moves on.
        tasks = [w.task for w in alive if w.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=_KILL_WAIT_SECONDS)
        return len(alive)
