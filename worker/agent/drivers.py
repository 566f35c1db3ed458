"""Submitted jobs' drivers that the scheduler placed on this node: started, logged, stopped.

The scheduler (:mod:`podium.scheduler.jobs`) runs a job's driver here when the job asks for
GPUs or resources this node holds (it reserved them with a placement group first). The agent
runs ``podium run -- ARGV`` with its own interpreter (for a job with a ``pip``/``uv`` set, in the
``PODIUM_RUNTIME_ENV`` its variables carry: behind the launcher, by that set's virtualenv from
the cache its workers use, :func:`podium.runtimeenv.driver_command`), behind the exec shim (the
driver dies with the agent, as an exec'd worker does), in a session and process group of its own, in a
private folder per driver where the job's packages were unpacked (checked again:
:mod:`podium.zippackage`). stdout and stderr go to one log file in that folder, which the
scheduler reads with ReadDriverLog into the job's log. When the driver ends, what is left of
its group is killed; the folder goes when the scheduler stops it or the agent stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess

from podium.auth import TlsConfig
from podium.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, ResourceExhaustedError
from podium.private import open_private, private_dir
from podium.process import die_with_parent_argv
from podium.resources import check_env_entries
from podium.runtimeenv import ENV_KEY, check_fields, driver_command, inherited
from podium.v1 import node_pb2
from podium.worker.agent.workerenv import TLS_ENV_KEYS
from podium.zippackage import MAX_DRIVER_PACKAGES_BYTES, unpack

__all__ = ["Drivers", "MAX_DRIVERS", "MAX_PACKAGE_BYTES", "MAX_READ_BYTES"]

log = logging.getLogger(__name__)

#: Drivers one node runs at once (the scheduler keeps at most 64 jobs live).
MAX_DRIVERS = 64
#: All packages of one StartDriver, together.
MAX_PACKAGE_BYTES = MAX_DRIVER_PACKAGES_BYTES
#: Most bytes one ReadDriverLog returns.
MAX_READ_BYTES = 1024 * 1024
#: Most arguments, and characters of all of them, of a driver's command.
MAX_ARGS = 256
MAX_ARG_CHARS = 256 * 1024
#: Seconds from SIGTERM to SIGKILL when none is given (Ray's job stop grace).
DEFAULT_GRACE = 3.0

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_FOLDER = re.compile(r"^(working_dir|py_modules/[0-9]{1,3})$")


class _Driver:
    def __init__(self, folder: pathlib.Path, proc: subprocess.Popen) -> None:
        self.folder = folder
        self.log_path = folder / "driver.log"
        self.proc = proc
        self.exit_code: int | None = None
        self.ended = asyncio.get_running_loop().create_future()


class Drivers:
    """The drivers of one node (all methods on the agent's event loop thread)."""

    def __init__(self, folder: str | os.PathLike, tls: TlsConfig | None = None,
                 state_dir: str | os.PathLike | None = None) -> None:
        self.folder = pathlib.Path(folder)
        #: The node's folder of runtime_env caches (the agent's log folder, as its workers'):
        #: a driver with a pip/uv set runs in the virtualenv its workers share.
        self.state_dir = pathlib.Path(state_dir) if state_dir is not None else self.folder
        #: The agent's mutual TLS files: its drivers call the scheduler with them.
        self.tls = tls
        self._drivers: dict[str, _Driver] = {}

    def _get(self, driver_id: str) -> _Driver:
        found = self._drivers.get(driver_id)
        if found is None:
            raise NotFoundError(f"no driver {driver_id!r} on this node")
        return found

    async def start(self, request: node_pb2.StartDriverRequest) -> node_pb2.StartDriverResponse:
        """Unpack the packages (a thread) and start the driver; InvalidArgumentError for a bad
        request, AlreadyExistsError when that driver runs already."""
        driver_id = request.driver_id
        if not _ID.match(driver_id):
            raise InvalidArgumentError(f"bad driver id {driver_id!r}")
        known = self._drivers.get(driver_id)
        if known is not None and known.exit_code is None:
            raise AlreadyExistsError(f"driver {driver_id!r} runs already (pid {known.proc.pid})")
        if sum(d.exit_code is None for d in self._drivers.values()) >= MAX_DRIVERS:
            raise ResourceExhaustedError(f"this node runs {MAX_DRIVERS} drivers already")
        argv = list(request.argv)
        if not argv or len(argv) > MAX_ARGS or sum(map(len, argv)) > MAX_ARG_CHARS or any("\0" in a for a in argv):
            raise InvalidArgumentError(f"a driver's argv must have 1 to {MAX_ARGS} arguments, "
                                       f"{MAX_ARG_CHARS} characters together, no NUL")
        check_env_entries(request.env, f"driver {driver_id}: env")
        # The job's pip/uv set travels as its actors' does: in the runtime env it passes on.
        try:
            pip = inherited(request.env).get("pip") if request.env.get(ENV_KEY) else None
        except (KeyError, TypeError, AttributeError):
            raise InvalidArgumentError(f"driver {driver_id}: env {ENV_KEY} holds a malformed pip set") from None
        if pip:
            check_fields((), "", (), f"driver {driver_id}", pip)
        if sum(len(p.zip) for p in request.packages) > MAX_PACKAGE_BYTES:
            raise InvalidArgumentError(f"a driver's packages are over {MAX_PACKAGE_BYTES} bytes together")
        relative = [request.cwd, *request.python_path]
        if any(r and not _FOLDER.match(r) for r in relative) or any(not _FOLDER.match(p.folder)
                                                                     for p in request.packages):
            raise InvalidArgumentError("a driver's folders are 'working_dir' or 'py_modules/N'")
        folder = self.folder / driver_id
        self._drivers.pop(driver_id, None)
        await asyncio.to_thread(self._unpack, folder, request)
        env = dict(os.environ)
        env.pop("PODIUM_TOKEN_FILE", None)
        env.update(request.env)
        paths = [str(folder / p) for p in request.python_path]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PYTHONUNBUFFERED"] = "1"
        for key in TLS_ENV_KEYS:
            env.pop(key, None)
        if self.tls is not None:
            env.update(zip(TLS_ENV_KEYS, (self.tls.cert, self.tls.key, self.tls.ca)))
        command = driver_command(self.state_dir, pip, argv)
        with open_private(folder / "driver.log") as out:
            proc = subprocess.Popen(die_with_parent_argv(command, signal.SIGKILL), cwd=folder / request.cwd,
                                    env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        driver = self._drivers[driver_id] = _Driver(folder, proc)
        asyncio.get_running_loop().create_task(self._reap(driver_id, driver))
        log.info("driver %s started, pid %d", driver_id, proc.pid)
        return node_pb2.StartDriverResponse(pid=proc.pid, log_path=str(driver.log_path))

    @staticmethod
    def _unpack(folder: pathlib.Path, request: node_pb2.StartDriverRequest) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        private_dir(folder)
        for package in request.packages:
            staged = folder / ".package.zip"
            staged.write_bytes(package.zip)
            try:
                unpack(staged, folder / package.folder)
            finally:
                staged.unlink()
        if request.cwd:
            (folder / request.cwd).mkdir(parents=True, exist_ok=True)

    async def _reap(self, driver_id: str, driver: _Driver) -> None:
        # A pidfd on the loop, as the spawner watches workers (no thread per driver held).
        loop, exited = asyncio.get_running_loop(), asyncio.Event()
        pidfd = os.pidfd_open(driver.proc.pid)
        loop.add_reader(pidfd, exited.set)
        try:
            while driver.proc.poll() is None:
                await exited.wait()
                exited.clear()
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        code = driver.proc.returncode
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(driver.proc.pid, signal.SIGKILL)  # what it started and left behind
        driver.exit_code = code
        driver.ended.set_result(code)
        log.info("driver %s ended with code %d", driver_id, code)

    def read(self, request: node_pb2.ReadDriverLogRequest) -> node_pb2.ReadDriverLogResponse:
        """Up to ``max_bytes`` of the driver's log from ``offset``; whether it has ended."""
        driver = self._get(request.driver_id)
        ended = driver.exit_code is not None  # before the read: nothing written after it is lost
        limit = min(request.max_bytes or MAX_READ_BYTES, MAX_READ_BYTES)
        offset = max(0, request.offset)
        try:
            with open(driver.log_path, "rb") as handle:
                handle.seek(offset)
                data = handle.read(limit)
        except FileNotFoundError:
            data = b""
        return node_pb2.ReadDriverLogResponse(data=data, next_offset=offset + len(data), ended=ended,
                                              exit_code=driver.exit_code or 0)

    async def stop(self, driver_id: str, grace: float = 0.0) -> bool:
        """SIGTERM its group, SIGKILL after ``grace``; True when it was running. A driver that
        had ended already is forgotten, its folder removed (the scheduler has read its log)."""
        driver = self._get(driver_id)
        running = driver.exit_code is None
        if not running:
            self.forget(driver_id)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(driver.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(driver.ended), grace if grace > 0 else DEFAULT_GRACE)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(driver.proc.pid, signal.SIGKILL)
                await driver.ended
        return running

    def forget(self, driver_id: str) -> None:
        """Remove an ended driver's folder and record."""
        driver = self._drivers.get(driver_id)
        if driver is not None and driver.exit_code is not None:
            del self._drivers[driver_id]
            shutil.rmtree(driver.folder, ignore_errors=True)

    async def stop_all(self) -> None:
        """Stop every driver (the agent is stopping) and remove their folders."""
        for driver_id in list(self._drivers):
            await self.stop(driver_id)
            self.forget(driver_id)

