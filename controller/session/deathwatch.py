"""Deaths the scheduler knows before the controller's connections do.

A worker that is SIGKILLed closes its sockets, so its pending calls fail at once. A worker
on a machine that froze, lost power or was cut off closes nothing: its calls would wait for
their deadline (an hour by default) although the scheduler declares the node dead after its
lease. So, while any watched worker has calls in flight, the controller asks the scheduler
every ``interval`` seconds (``PODIUM_DEATH_WATCH_SECONDS``, default 1) about those workers,
and fails the pending calls of each one the scheduler reports ended with WorkerDiedError
(naming rank, node and the scheduler's reason). One small RPC per interval, only while
calls are pending; nothing at all when the controller is idle.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from typing import TYPE_CHECKING, Any

from podium.controller.session.liveness import Liveness
from podium.errors import WorkerDiedError


if TYPE_CHECKING:
    from podium.controller.session.core import SessionCore

__all__ = ["DeathWatch", "died_error"]

log = logging.getLogger("podium.controller")

#: Seconds between two looks at the scheduler while calls are pending.
DEFAULT_INTERVAL = float(os.environ.get("PODIUM_DEATH_WATCH_SECONDS") or 1.0)

def died_error(info: Any, rank: int, name: str, what: str) -> WorkerDiedError:
    """WorkerDiedError from the scheduler's WorkerInfo of an ended worker."""
    import re
    ex = info.exit
    signal = ex.signal or None
    # The error's own text ends "(killed by SIGKILL)" / "(exit code 1)": not twice.
    reason = re.sub(r"\s*\(?(killed by [^)]*|exited with code -?\d+)\)?$", "", ex.reason)
    return WorkerDiedError(
        f"worker rank {rank} ({name}) on node {info.node_id} ({info.node_address}) died "
        f"during {what}" + (f": {reason}" if reason else ""),
        exit_code=None if signal or ex.exit_code < 0 else ex.exit_code, signal=signal,
        stderr_tail=ex.stderr_tail, node=info.node_id, rank=rank)


class DeathWatch:
    """Watches the workers of one runtime's groups (see the module docstring)."""

    def __init__(self, runtime: SessionCore, interval: float = DEFAULT_INTERVAL) -> None:
        self._runtime = runtime
        self.interval = interval
        #: worker id -> its WorkerClient (weak: a group dropped without shutdown drops out).
        self._clients: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
        self._task: asyncio.Task | None = None
        #: How many workers it found dead (for tests and stats).
        self.found = 0
        #: The same workers' liveness: ranks that stop answering (podium.controller.session.liveness).
        self.liveness = Liveness(runtime)

    def watch(self, worker_id: str, client: Any, *, liveness: bool = True) -> None:
        """Watch one worker (call on the runtime's loop); ``liveness``: its pings too."""
        if liveness:
            self.liveness.watch(worker_id, client)
        self._clients[worker_id] = client
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def forget(self, worker_ids: list[str]) -> None:
        """Stop watching these workers; the watch ends with the last one."""
        self.liveness.forget(worker_ids)
        for worker_id in worker_ids:
            self._clients.pop(worker_id, None)
        if not self._clients and self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        from podium.v1 import common_pb2
        ended = (common_pb2.WORKER_EXITED, common_pb2.WORKER_FAILED)
        while self._clients and not self._runtime.closed:
            await asyncio.sleep(self.interval)
            busy = {wid: c for wid, c in list(self._clients.items())
                    if c.pending and c.broken is None}
            if not busy:
                continue
            try:
                infos = await self._runtime.scheduler.get_workers(ids=list(busy))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the scheduler may be restarting; look again
                log.debug("death watch: cannot ask the scheduler: %s", exc)
                continue
            for info in infos:
                client = busy.get(info.id)
                if client is None or info.state not in ended or client.broken is not None:
                    continue
                self.found += 1
                client.fail_pending(died_error(info, client.rank, info.spec.name, "a pending call"))
