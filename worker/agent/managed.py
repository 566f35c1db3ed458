"""One worker process as its node agent tracks it (:class:`ManagedWorker`)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import pathlib
import subprocess
import threading
from typing import TYPE_CHECKING, Callable

from podium.private import open_private
from podium.v1 import common_pb2
from podium.worker.agent.exitinfo import HEADER_PREFIX

if TYPE_CHECKING:
    from podium.worker.agent.forkserver import ForkedProcess

log = logging.getLogger(__name__)

__all__ = ["ManagedWorker", "parse_ready", "ready_cap"]


class ManagedWorker:
    """One worker process the agent started, and what it knows about it."""

    def __init__(self, info: common_pb2.WorkerInfo, out_path: pathlib.Path,
                 err_path: pathlib.Path) -> None:
        self.info = info
        self.out_path = out_path
        self.err_path = err_path
        self.pid = 0
        self.port = 0
        self.state = common_pb2.WORKER_STARTING
        self.exit: common_pb2.ExitInfo | None = None
        self.stop_requested = False
        #: Its process: started by exec, or forked by the fork server.
        self.proc: subprocess.Popen | ForkedProcess | None = None
        loop = asyncio.get_running_loop()
        #: Resolves to the Popen return code when the process is reaped.
        self.exited: asyncio.Future[int] = loop.create_future()
        #: Resolves to the ready line's bytes (b"" when the pipe closed without one).
        self.ready: asyncio.Future[bytes] = loop.create_future()
        self.task: asyncio.Task | None = None
        #: Stops watching the ready pipe (set by the spawner).
        self.close_ready: Callable[[], None] = lambda: None
        #: The GPU memory cap its ready line reported (None: none asked).
        self.gpu_memory_cap: common_pb2.GpuMemoryCap | None = None

    @property
    def id(self) -> str:
        """Worker id ("w-...")."""
        return self.info.id

    @contextlib.contextmanager
    def log_files(self, node_id: str):
        """Its stdout and stderr files, opened for appending, each headed by a line that names
        the worker."""
        info = self.info
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        header = f"{HEADER_PREFIX}{info.spec.name or info.id} id={info.id} node={node_id} started {now}\n"
        with open_private(self.out_path) as out, open_private(self.err_path) as err:
            for handle in (out, err):
                handle.write(header.encode())
                handle.flush()
            yield out, err

    @property
    def alive(self) -> bool:
        """True until the process has been reaped."""
        return self.pid > 0 and not self.exited.done()

    @property
    def ended(self) -> bool:
        """True once the process is reaped and its end has been reported."""
        return self.exited.done() and (self.task is None or self.task.done())

    def watch_exit(self, proc: subprocess.Popen | ForkedProcess) -> None:
        """Resolve :attr:`exited` when ``proc`` is reaped (a pidfd on the loop; the fork server's
        report for a forked one)."""
        loop = asyncio.get_running_loop()

        def reaped(returncode: int) -> None:
            if not self.exited.done():
                self.exited.set_result(returncode)

        if not isinstance(proc, subprocess.Popen):  # the fork server reaps it and reports
            proc.on_exit(reaped)
            return

        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            # No pidfd (old kernel): a waiting thread per worker does the same job.
            threading.Thread(target=lambda: loop.call_soon_threadsafe(reaped, proc.wait()),
                             name=f"reap-{self.id}", daemon=True).start()
            return

        def on_readable() -> None:
            code = proc.poll()
            if code is None:  # spurious wake-up; the process is still there
                return
            loop.remove_reader(pidfd)
            os.close(pidfd)
            reaped(code)

        loop.add_reader(pidfd, on_readable)

    def watch_ready(self, read_fd: int) -> None:
        """Resolve :attr:`ready` with the line the process writes to its ready pipe ``read_fd``
        (b"" when it closes without one); the pipe is closed then."""
        loop = asyncio.get_running_loop()
        os.set_blocking(read_fd, False)
        buffer = bytearray()

        closed = False

        def finish(line: bytes) -> None:
            nonlocal closed
            if not closed:
                closed = True
                loop.remove_reader(read_fd)
                os.close(read_fd)
            if not self.ready.done():
                self.ready.set_result(line)

        def on_readable() -> None:
            try:
                chunk = os.read(read_fd, 4096)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                finish(bytes(buffer))
                return
            buffer.extend(chunk)
            if b"\n" in buffer or len(buffer) > 65536:
                finish(bytes(buffer))

        loop.add_reader(read_fd, on_readable)
        self.close_ready = lambda: finish(b"")

    def to_proto(self) -> common_pb2.WorkerInfo:
        """WorkerInfo with this agent's view (state, pid, port, exit, log path)."""
        out = common_pb2.WorkerInfo()
        out.CopyFrom(self.info)
        out.state, out.pid, out.port, out.log_path = self.state, self.pid, self.port, str(self.out_path)
        if self.exit is not None:
            out.exit.CopyFrom(self.exit)
        if self.gpu_memory_cap is not None:
            out.gpu_memory_cap.CopyFrom(self.gpu_memory_cap)
        return out


def parse_ready(line: bytes) -> tuple[int, str]:
    """(port, "") from a ready line, or (0, why it is unusable)."""
    if not line.strip():
        return 0, "closed its ready pipe without a port"
    try:
        port = json.loads(line.decode("utf-8", errors="replace").strip())["port"]
        if isinstance(port, int) and 0 < port < 65536:
            return port, ""
    except (ValueError, KeyError, TypeError):
        pass
    return 0, f"bad ready line {line[:200]!r}"


def ready_cap(line: bytes) -> common_pb2.GpuMemoryCap | None:
    """The GPU memory cap a (valid) ready line reports, or None (none asked, or unreadable:
    the cap is a report, so a bad one is logged and dropped, never fatal)."""
    try:
        fields = json.loads(line.decode("utf-8", errors="replace").strip()).get("gpu_memory_cap")
        return None if fields is None else common_pb2.GpuMemoryCap(**fields)
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("ignoring the GPU memory cap of ready line %r: %s", line[:200], exc)
        return None
