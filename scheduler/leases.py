"""The scheduler's lease checker: the background task that expires nodes and sessions.

Every ``interval`` seconds it marks the nodes and sessions whose lease ran out (through
:meth:`ClusterModel.expire <podium.scheduler.state.ClusterModel.expire>`), has the service
persist and carry out what that changed, and ends the heartbeat streams gone silent. A
wake-up much later than asked means the scheduler's own loop was stalled (a slow request,
swapping, a SIGSTOP): heartbeats waited unread meanwhile, so every lease restarts instead
(issue #14).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from podium.scheduler.heartbeats import HeartbeatStreams
from podium.scheduler.records import Effects
from podium.scheduler.state import ClusterModel

log = logging.getLogger(__name__)

__all__ = ["LeaseChecker", "STALL_SECONDS"]

#: A lease checker that wakes this much later than it asked was stalled.
STALL_SECONDS = 1.0


class LeaseChecker:
    """Expires the leases of ``model`` on a timer, on the serving loop (see the module docstring).

    ``settle`` persists what a check changed and stops the workers in its effects (the
    service's job); ``clock`` is the model's clock (Unix seconds).
    """

    def __init__(self, model: ClusterModel, streams: HeartbeatStreams, *,
                 clock: Callable[[], float], node_lease: float, session_lease: float,
                 settle: Callable[[Effects], Awaitable[None]],
                 interval: float | None = None) -> None:
        self.model = model
        self.streams = streams
        self.clock = clock
        self.node_lease = node_lease
        #: Seconds between checks: a quarter of the shorter lease unless given.
        self.interval = interval or max(0.05, min(node_lease, session_lease) / 4)
        #: A wake-up this much late is a stall of the loop.
        self.stall = min(STALL_SECONDS, node_lease / 4, session_lease / 4)
        self._settle = settle
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start checking (call on the serving loop; a second call does nothing)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop checking and wait until the task has ended."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        interval = self.interval
        loop = asyncio.get_running_loop()
        woke = loop.time()
        while True:
            await asyncio.sleep(interval)
            slept, woke = loop.time() - woke, loop.time()
            try:
                await self.check(stalled_for=slept - interval)
            except Exception:  # noqa: BLE001 - the checker must keep running
                log.exception("lease check failed")

    async def check(self, stalled_for: float = 0.0) -> None:
        """One check: excuse a stall longer than ``self.stall``, expire, settle, end silent
        streams (one silent for two node leases: its node is dead by then anyway)."""
        if stalled_for > self.stall:
            log.warning("scheduler loop stalled for %.1f s; leases restart now", stalled_for)
            self.model.excuse_stall(self.clock())
            self.streams.excuse()
        effects = self.model.expire(self.clock())
        await self._settle(effects)
        await self.streams.end_idle(2 * self.node_lease)
