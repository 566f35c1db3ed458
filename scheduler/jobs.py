"""Submitted jobs run by the scheduler: each driver a supervised process on its machine.

A job's entrypoint runs as ``podium run -- /bin/sh -c ENTRYPOINT`` (so ``import ray`` is
Podium's stand-in), in a session and process group of its own, in its unpacked
``working_dir`` (its ``py_modules`` and that folder on ``PYTHONPATH``), with
``runtime_env.env_vars`` applied and ``PODIUM_ADDRESS``, ``PODIUM_TOKEN``, ``RAY_ADDRESS``,
``RAY_JOB_ID``, ``RAY_JOB_SUBMISSION_ID`` and ``PODIUM_JOB_ID`` set. The scheduler is its
supervisor: it pipes the output into the job's log (:mod:`podium.scheduler.joblog`), keeps
the record in the state file, and when the driver ends (or is stopped: SIGTERM to its
process group, SIGKILL after :data:`STOP_GRACE_SECONDS`) kills what is left of the group
and closes the controller sessions the driver opened (their descriptions name the job),
which removes its placement groups and stops its workers.

The driver does not depend on whoever submitted it. It does depend on its supervisor: a
scheduler that stops stops its jobs first, and one that restarts after dying marks the jobs
it was running FAILED (``JOB_SUPERVISOR_ACTOR_DIED``) and kills what is left of them.
Entrypoint CPUs are counted against the machine's: a job that does not fit yet waits PENDING.
A job that asks for GPUs, resources or more CPUs than that machine has runs on a node of the
cluster that holds them instead, through its agent (:mod:`podium.scheduler.jobnodes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import grpc

from podium import errors
from podium.private import private_dir
from podium.runtimeenv import driver_command, driver_env
from podium.scheduler.joblog import READ_CHUNK, JobLog
from podium.scheduler.jobnodes import bundle_of, driver_request, wants_node
from podium.zippackage import MAX_DRIVER_PACKAGES_BYTES
from podium.scheduler.jobpackages import PackageStore, package_name_of, unpack
from podium.scheduler.jobrecords import (FAILED, MESSAGE_TAIL, MAX_JOB_RECORDS, MAX_LIVE_JOBS,
                                         PENDING, RUNNING, RUNTIME_ENV_FAILURE, START_ERROR, STOPPED,
                                         SUCCEEDED, SUPERVISOR_DIED, JobRecord, SubmitRequest,
                                         failure_of, new_submission_id, pip_of)

log = logging.getLogger(__name__)

__all__ = ["JobManager", "STOP_GRACE_SECONDS", "session_prefix"]

#: Seconds between SIGTERM and SIGKILL when a job is stopped (Ray's default is 3).
STOP_GRACE_SECONDS = 3.0
#: After the driver exits, how long output still held by its leftovers is read.
_DRAIN_SECONDS = 2.0


def session_prefix(submission_id: str) -> str:
    """How the description of a session opened by job ``submission_id``'s driver starts."""
    return f"job {submission_id}: "


def _now_ms() -> int:
    return int(time.time() * 1000)


def _start_ticks(pid: int) -> int:
    """A process's start time (/proc ticks since boot); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


async def _exited(proc: subprocess.Popen) -> int:
    """Wait for ``proc`` to exit (its pidfd readable on the loop), reap it, its exit status
    (negative: the signal that ended it)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): a thread waits
        return await asyncio.to_thread(proc.wait)
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not ended.done():
            ended.set_result(None)
    loop.add_reader(pidfd, readable)
    try:
        await ended
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return proc.wait()


def _ours(pid: int, start: int) -> bool:
    """Whether the process group ``pid`` is still the driver's that started at ``start``: its
    leader is that process, or it is gone and only members are left (the kernel gives no new
    process a pid still in use as a group's id, so such members are the driver's)."""
    ticks = _start_ticks(pid)
    return ticks == 0 or ticks == start


def _kill_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False when no process of it is left."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class JobManager:
    """The jobs of one scheduler: records, their drivers, packages and logs.

    ``folder`` holds ``packages/`` and one folder per job; ``store`` keeps the records;
    ``end_sessions(prefix)`` closes the sessions a driver opened; ``cpus`` is what entrypoint
    CPUs are counted against (this machine's); ``grace`` the seconds from SIGTERM to SIGKILL.
    """

    def __init__(self, folder: str | os.PathLike, store, end_sessions, *, token: str,
                 tls=None, cpus: float | None = None, grace: float = STOP_GRACE_SECONDS, nodes=None) -> None:
        self.folder = private_dir(folder)
        self.packages = PackageStore(self.folder / "packages")
        self.store = store
        self.end_sessions = end_sessions
        self.token = token
        self.tls = tls
        self.cpus = float(cpus if cpus is not None else (os.cpu_count() or 1))
        self.grace = grace
        #: Placement of drivers on the cluster's nodes (podium.scheduler.jobnodes.JobNodes), if any.
        self.nodes = nodes
        self.address = ""
        self.node_address = ""
        self.jobs: dict[str, JobRecord] = {}
        self.logs: dict[str, JobLog] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._closing = False

    # ------------------------------------------------------------ lifecycle

    async def start(self, address: str, node_address: str) -> None:
        """Load the records; jobs a dead supervisor left running are FAILED and their
        leftovers killed. ``address`` is the scheduler's gRPC ``host:port`` for the drivers."""
        self.address, self.node_address = address, node_address
        for doc in self.store.load_jobs():
            job = JobRecord.from_json(doc)
            self.jobs[job.submission_id] = job
            if job.terminal:
                continue
            left = ""
            if job.driver_group and self.nodes is not None:
                self.nodes.abandon(job)  # its driver on another node, and its reservation
            elif job.pid and not job.driver_group and _ours(job.pid, job.pid_start) and _kill_group(job.pid, signal.SIGKILL):
                left = f"; its driver (pid {job.pid}) was still running and was killed"
            self._end(job, FAILED, SUPERVISOR_DIED,
                      f"Job supervisor died: the scheduler stopped while the job was {job.status}{left}.")
            await self._end_sessions(job)

    async def close(self) -> None:
        """Stop every live job (the scheduler is stopping): SIGTERM, SIGKILL after the grace."""
        self._closing = True
        for job in list(self.jobs.values()):
            if not job.terminal:
                job.stop_requested = True
                if job.driver_group and self.nodes is not None:
                    self._stop_placed(job)
                elif job.pid:
                    self._signal(job)
        tasks = list(self._tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=self.grace + _DRAIN_SECONDS + 5)
        for task in tasks:
            task.cancel()

    # ------------------------------------------------------------ the API's operations

    def live(self) -> list[JobRecord]:
        """Jobs PENDING or RUNNING."""
        return [j for j in self.jobs.values() if not j.terminal]

    def get(self, submission_id: str) -> JobRecord:
        """A job by id; NotFoundError (404) otherwise."""
        job = self.jobs.get(submission_id)
        if job is None:
            raise errors.NotFoundError(f"Job {submission_id} does not exist")
        return job

    def log_of(self, job: JobRecord) -> JobLog:
        """The job's log files."""
        found = self.logs.get(job.submission_id)
        if found is None:
            found = self.logs[job.submission_id] = JobLog(self._job_dir(job))
        return found

    def submit(self, request: SubmitRequest) -> JobRecord:
        """Record a job and start it (or queue it PENDING until its CPUs are free)."""
        if self._closing:
            raise errors.UnavailableError("the scheduler is stopping; submit again once it is back")
        if len(self.live()) >= MAX_LIVE_JOBS:
            raise errors.ResourceExhaustedError(
                f"{MAX_LIVE_JOBS} jobs are PENDING or RUNNING already; stop one or wait for one to end")
        placed = wants_node(request, self.cpus)
        if placed and self.nodes is None:
            raise errors.InvalidArgumentError(
                "entrypoint_num_gpus, entrypoint_resources and entrypoint_num_cpus beyond this machine's "
                f"{self.cpus:g} need a cluster scheduler, which places the driver on a node")
        env = request.runtime_env
        size = 0
        for uri in [env.get("working_dir"), *(env.get("py_modules") or [])]:
            if uri is not None:
                try:
                    size += self.packages.require(uri).stat().st_size  # a bad request now, not a FAILED job
                except errors.NotFoundError as exc:
                    raise errors.InvalidArgumentError(str(exc)) from None
        if placed and size > MAX_DRIVER_PACKAGES_BYTES:
            raise errors.InvalidArgumentError(
                f"a job whose driver runs on another node takes its packages there in one message: "
                f"at most {MAX_DRIVER_PACKAGES_BYTES} bytes, these are {size}")
        submission_id = request.submission_id or new_submission_id()
        if submission_id in self.jobs:
            raise errors.AlreadyExistsError(f"Job with submission_id {submission_id} already exists. "
                                            f"Please use a different submission_id.")
        group = self.nodes.reserve(submission_id, bundle_of(request)) if placed else ""
        job = JobRecord(submission_id=submission_id, entrypoint=request.entrypoint, start_time=_now_ms(),
                        metadata=request.metadata or None, runtime_env=env or None,
                        entrypoint_num_cpus=request.entrypoint_num_cpus,
                        entrypoint_num_gpus=request.entrypoint_num_gpus,
                        entrypoint_memory=request.entrypoint_memory,
                        entrypoint_resources=request.entrypoint_resources, driver_group=group)
        # Ray's PENDING message, with its hints.
        hints = [" It may be waiting for resources (CPUs, GPUs, memory, custom resources) to become "
                 "available." if request.entrypoint_num_cpus else "",
                 " It may be waiting for the runtime environment to be set up." if env else ""]
        job.message = "Job has not started yet." + "".join(hints)
        self.jobs[submission_id] = job
        self._save(job)
        self._prune()
        self._start_pending()
        return job

    def stop(self, submission_id: str) -> bool:
        """Ask a job to stop: True when it was live (it ends STOPPED), False when it had
        ended already (nothing is done)."""
        job = self.get(submission_id)
        if job.terminal:
            return False
        job.stop_requested = True
        if submission_id not in self._tasks:  # still queued: it never ran
            self._end(job, STOPPED, None, None)
            self._start_pending()
        elif job.driver_group:
            self._stop_placed(job)
        elif job.pid:
            self._signal(job)
        return True

    def delete(self, submission_id: str) -> bool:
        """Forget an ended job, its log and working dir; FailedPreconditionError while it is live."""
        job = self.get(submission_id)
        if not job.terminal:
            raise errors.FailedPreconditionError(
                f"Attempted to delete job '{submission_id}', but it is in a non-terminal state "
                f"{job.status}. Stop it first.")
        self._forget(job)
        return True

    def packages_in_use(self) -> set[str]:
        """Package names that live jobs still need."""
        names = set()
        for job in self.live():
            env = job.runtime_env or {}
            for uri in [env.get("working_dir"), *(env.get("py_modules") or [])]:
                if uri:
                    names.add(package_name_of(uri))
        return names

    # ------------------------------------------------------------ running

    def _job_dir(self, job: JobRecord) -> Path:
        return self.folder / "jobs" / job.submission_id

    def _start_pending(self) -> None:
        used = sum(j.entrypoint_num_cpus or 0 for j in self.jobs.values()
                   if j.submission_id in self._tasks and not j.terminal and not j.driver_group)
        for job in list(self.jobs.values()):
            if job.status != PENDING or job.submission_id in self._tasks or job.terminal:
                continue
            cpus = 0 if job.driver_group else job.entrypoint_num_cpus or 0  # the scheduler counts placed ones
            if used + cpus > self.cpus:
                continue
            used += cpus
            self._tasks[job.submission_id] = asyncio.get_running_loop().create_task(self._run(job))

    async def _run(self, job: JobRecord) -> None:
        try:
            await self._supervise(job)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug must end the job, not leave it RUNNING
            log.exception("job %s: supervisor failed", job.submission_id)
            if job.pid and not job.driver_group:
                _kill_group(job.pid, signal.SIGKILL)
            if not job.terminal:
                self._end(job, FAILED, SUPERVISOR_DIED, f"Job supervisor failed: {type(exc).__name__}: {exc}")
        finally:
            self._tasks.pop(job.submission_id, None)
            if not job.terminal:  # cancelled: the scheduler is going away
                self._end(job, FAILED, SUPERVISOR_DIED, "Job supervisor died: the scheduler stopped.")
            with contextlib.suppress(Exception):
                await self._end_sessions(job)
            if job.driver_group and self.nodes is not None:
                await self.nodes.release(job.driver_group)
            # The unpacked packages go with the driver (its log stays with the record), unless
            # the job was deleted meanwhile and its id reused: the folder is the new job's then.
            folder = self._job_dir(job)
            for name in ("working_dir", "py_modules"):
                if self.jobs.get(job.submission_id) is job:
                    await asyncio.to_thread(shutil.rmtree, folder / name, True)
            if not self._closing:
                self._start_pending()

    async def _supervise(self, job: JobRecord) -> None:
        logfile = self.log_of(job)
        try:
            cwd, env = await asyncio.to_thread(self._prepare, job)
        except (errors.PodiumError, OSError) as exc:
            self._end(job, FAILED, RUNTIME_ENV_FAILURE, f"runtime_env setup failed: {exc}")
            return
        if job.stop_requested:
            self._end(job, STOPPED, None, None)
            return
        if job.driver_group:
            await self._supervise_placed(job, logfile, cwd, env)
            return
        # With pip/uv, the launcher makes the virtualenv in this machine's cache (a failed
        # install is the driver's exit: _ended tells it apart) and runs the driver by its python.
        command = driver_command(self.folder, pip_of(job.runtime_env), ["/bin/sh", "-c", job.entrypoint])
        try:
            # The stdlib's vfork+exec, not the event loop's own spawn (uvloop forks: in a
            # process with gRPC's threads that runs its fork handlers and copies the page
            # tables of the whole scheduler, on the loop).
            proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            self._end(job, FAILED, START_ERROR, f"Job entrypoint command failed to start: {exc}")
            return
        job.pid, job.pid_start = proc.pid, _start_ticks(proc.pid)
        job.node_address = self.node_address
        job.status, job.message = RUNNING, "Job is currently running."
        self._save(job)
        if job.stop_requested:  # stopped while it was being set up
            self._signal(job)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=READ_CHUNK)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), proc.stdout)
        pump = loop.create_task(self._pump(reader, logfile))
        code = await _exited(proc)
        _kill_group(job.pid, signal.SIGKILL)  # what the driver started and left behind
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(pump), _DRAIN_SECONDS)
        pump.cancel()
        job.driver_exit_code = code
        if self._closing:
            self._end(job, FAILED, SUPERVISOR_DIED,
                      "Job supervisor died: the scheduler stopped, and stopped the job's driver first.")
        else:
            self._ended(job, code, logfile)

    def _ended(self, job: JobRecord, code: int, logfile: JobLog) -> None:
        """End a job whose driver exited with ``code``."""
        if job.stop_requested:
            self._end(job, STOPPED, None, None)
        elif code == 0:
            self._end(job, SUCCEEDED, None, None)
        else:
            self._end(job, FAILED, *failure_of(job, code, logfile.tail(MESSAGE_TAIL).decode(errors="replace")))

    async def _supervise_placed(self, job: JobRecord, logfile: JobLog, cwd: str, env: dict[str, str]) -> None:
        """Run the driver on the node its reservation is on (podium.scheduler.jobnodes)."""
        request = await asyncio.to_thread(driver_request, job, self.packages, env)

        def started(pid: int) -> None:
            job.pid, job.pid_start = pid, 0
            job.status, job.message = RUNNING, f"Job is currently running (on node {job.node_id})."
            self._save(job)
            if job.stop_requested:
                self._stop_placed(job)
        try:
            code = await self.nodes.run(job, request, logfile.append, started)
        except (errors.PodiumError, grpc.aio.AioRpcError) as exc:
            text = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            if job.stop_requested:
                self._end(job, STOPPED, None, None)
            else:
                self._end(job, FAILED, SUPERVISOR_DIED if job.pid else START_ERROR,
                          f"Job driver on node {job.node_id or '(not placed)'} failed: {text}")
            return
        job.driver_exit_code = code
        self._ended(job, code, logfile)

    def _stop_placed(self, job: JobRecord) -> None:
        """Stop a placed job's driver on its node, or drop its reservation while it waits."""
        loop = asyncio.get_running_loop()
        if job.pid and job.node_id:
            loop.create_task(self.nodes.stop_driver(job.node_id, job.submission_id, self.grace))
        else:
            loop.create_task(self.nodes.release(job.driver_group))

    async def _pump(self, stream: asyncio.StreamReader, logfile: JobLog) -> None:
        while chunk := await stream.read(READ_CHUNK):
            logfile.append(chunk)

    def _prepare(self, job: JobRecord) -> tuple[str, dict[str, str]]:
        """Unpack the packages (a thread: file work) and make the driver's environment."""
        folder = private_dir(self._job_dir(job))
        env_spec = job.runtime_env or {}
        cwd = folder
        paths = []
        if env_spec.get("working_dir"):
            cwd = folder / "working_dir"
            if not cwd.exists():
                unpack(self.packages.require(env_spec["working_dir"]), cwd)
            paths.append(str(cwd))
        for index, uri in enumerate(env_spec.get("py_modules") or []):
            target = folder / "py_modules" / str(index)
            if not target.exists():
                unpack(self.packages.require(uri), target)
            paths.append(str(target))
        env = dict(os.environ)
        for name in ("PODIUM_TOKEN_FILE", "RAY_ADDRESS", "PYTHONSTARTUP"):
            env.pop(name, None)
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env.update({"PODIUM_ADDRESS": self.address, "PODIUM_TOKEN": self.token,
                    "RAY_ADDRESS": self.address, "RAY_JOB_ID": job.submission_id,
                    "RAY_JOB_SUBMISSION_ID": job.submission_id, "PODIUM_JOB_ID": job.submission_id,
                    "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(paths)})
        if not paths:
            env.pop("PYTHONPATH")
        if self.tls is not None:
            env.update({"PODIUM_TLS_CERT": self.tls.cert, "PODIUM_TLS_KEY": self.tls.key,
                        "PODIUM_TLS_CA": self.tls.ca})
        env.update(driver_env(env_spec.get("py_executable"), pip_of(env_spec)))  # its actors and tasks inherit it
        env.update(env_spec.get("env_vars") or {})
        return str(cwd), env

    def _signal(self, job: JobRecord) -> None:
        """SIGTERM to the driver's process group now, SIGKILL after the grace."""
        if _kill_group(job.pid, signal.SIGTERM):
            loop = asyncio.get_running_loop()
            pid, start = job.pid, job.pid_start

            def kill() -> None:
                if _ours(pid, start):
                    _kill_group(pid, signal.SIGKILL)
            loop.call_later(self.grace, kill)

    async def _end_sessions(self, job: JobRecord) -> None:
        closed = await self.end_sessions(session_prefix(job.submission_id))
        if closed:
            log.info("job %s ended: closed %d controller session(s) it left open", job.submission_id, closed)

    # ------------------------------------------------------------ records

    def _end(self, job: JobRecord, status: str, error_type: str | None, message: str | None) -> None:
        job.status, job.error_type, job.end_time = status, error_type, _now_ms()
        job.message = message
        job.__post_init__()  # Ray's default message for the status when none is given
        self._save(job)
        found = self.logs.get(job.submission_id)
        if found is not None:
            found.close()

    def _save(self, job: JobRecord) -> None:
        self.store.put_job(job.submission_id, job.to_json())

    def _forget(self, job: JobRecord) -> None:
        self.jobs.pop(job.submission_id, None)
        found = self.logs.pop(job.submission_id, None)
        if found is not None:
            found.close()
        self.store.delete_job(job.submission_id)
        shutil.rmtree(self._job_dir(job), ignore_errors=True)

    def _prune(self) -> None:
        """Forget the oldest ended jobs beyond :data:`MAX_JOB_RECORDS`."""
        extra = len(self.jobs) - MAX_JOB_RECORDS
        if extra <= 0:
            return
        for job in [j for j in self.jobs.values() if j.terminal][:extra]:
            self._forget(job)
