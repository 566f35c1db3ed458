"""One worker process as its node agent tracks it (:class:`ManagedWorker`)."""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
from typing import TYPE_CHECKING, Callable

from podium.v1 import common_pb2

if TYPE_CHECKING:
    from podium.worker.agent.forkserver import ForkedProcess

__all__ = ["ManagedWorker"]


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

    @property
    def alive(self) -> bool:
        """True until the process has been reaped."""
        return self.pid > 0 and not self.exited.done()

    @property
    def ended(self) -> bool:
        """True once the process is reaped and its end has been reported."""
        return self.exited.done() and (self.task is None or self.task.done())

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
