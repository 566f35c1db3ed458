"""A node's link to the scheduler: register, heartbeat, register again, back off.

:class:`SchedulerLink` is the loop every node agent runs (:mod:`podium.worker.agent.service`),
written once: register the node; heartbeat at the interval the scheduler answers with; when a
heartbeat fails or the scheduler asks, register again; while the scheduler cannot be reached,
retry with a backoff that doubles up to :data:`MAX_BACKOFF_SECONDS` (and, once registered, up
to the heartbeat interval: a restarted scheduler must hear from the node well within the node
lease it restores). It knows no gRPC: it is given the two calls, so a load-test harness can
drive many of them with simulated nodes over shared connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from podium import errors
from podium.v1 import scheduler_pb2

log = logging.getLogger(__name__)

__all__ = ["SchedulerLink", "MAX_BACKOFF_SECONDS", "DEFAULT_HEARTBEAT_SECONDS", "RETRYABLE"]

#: Heartbeat interval when the scheduler does not say.
DEFAULT_HEARTBEAT_SECONDS = 2.0
#: Retry delays towards an unreachable scheduler grow up to this.
MAX_BACKOFF_SECONDS = 5.0
#: First retry delay after a failed registration.
FIRST_BACKOFF_SECONDS = 0.1
#: Errors worth retrying: the scheduler is down or slow, not the request wrong.
RETRYABLE = (errors.UnavailableError, errors.DeadlineExceededError, errors.CancelledError)


class SchedulerLink:
    """One node's registration and heartbeats, until ``stop`` is set.

    ``register()`` sends RegisterNode (what the node is and runs) and ``beat()`` one
    heartbeat; both raise :mod:`podium.errors` on failure. ``unwanted(ids)`` is told the
    workers the scheduler no longer wants. ``jitter()``, when given, scales each retry delay
    (0.5 + a random fraction: many nodes retrying together do not stay in step);
    ``spread()``, when given, delays the first heartbeat by that fraction of an interval
    (machines started together do not all beat at one instant).
    """

    def __init__(self, node_id: str, *,
                 register: Callable[[], Awaitable[scheduler_pb2.RegisterNodeResponse]],
                 beat: Callable[[], Awaitable[scheduler_pb2.HeartbeatResponse]],
                 unwanted: Callable[[Sequence[str]], None],
                 stop: asyncio.Event | None = None,
                 jitter: Callable[[], float] | None = None,
                 spread: Callable[[], float] | None = None,
                 scheduler: str = "") -> None:
        self.node_id = node_id
        self._register = register
        self._beat = beat
        self._unwanted = unwanted
        self.stop = stop if stop is not None else asyncio.Event()
        self._jitter = jitter
        self._spread = spread
        self._scheduler = scheduler
        #: Set whenever a registration succeeds; cleared when the scheduler is lost.
        self.registered = asyncio.Event()
        #: Successful RegisterNode calls so far (a re-registration adds one).
        self.registrations = 0
        #: Heartbeats the scheduler answered.
        self.heartbeats = 0
        #: Id of the scheduler incarnation last registered with.
        self.scheduler_id = ""

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless stopping; True when the link is stopping."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)
        return self.stop.is_set()

    async def run(self) -> None:
        """Register and heartbeat until ``stop`` is set (see the class docstring)."""
        backoff, outage_logged = FIRST_BACKOFF_SECONDS, False
        max_backoff = MAX_BACKOFF_SECONDS
        while not self.stop.is_set():
            try:
                response = await self._register()
            except errors.PodiumError as error:
                if not outage_logged:
                    # Unreachable is normal (it restarts); a refusal means misconfiguration.
                    level = logging.WARNING if isinstance(error, RETRYABLE) else logging.ERROR
                    log.log(level, "node %s cannot register with the scheduler (will retry): %s",
                            self.node_id, error)
                    outage_logged = True
                delay = backoff * (0.5 + self._jitter()) if self._jitter is not None else backoff
                if await self.sleep(delay):
                    return
                backoff = min(backoff * 2, max_backoff)
                continue
            backoff, outage_logged = FIRST_BACKOFF_SECONDS, False
            self.scheduler_id = response.scheduler_id
            first = self.registrations == 0
            self.registrations += 1
            self.registered.set()
            interval = response.heartbeat_interval_seconds or DEFAULT_HEARTBEAT_SECONDS
            max_backoff = min(MAX_BACKOFF_SECONDS, interval)
            log.info("registered node %s with scheduler %s (heartbeat every %g s)",
                     self.node_id, response.scheduler_id or self._scheduler, interval)
            wait = interval * self._spread() if first and self._spread is not None else interval
            await self._heartbeats(interval, wait)
            self.registered.clear()

    async def _heartbeats(self, interval: float, wait: float) -> None:
        """Heartbeat until the scheduler is lost or wants a new registration."""
        while not await self.sleep(wait):
            wait = interval
            try:
                response = await self._beat()
            except errors.PodiumError as error:
                log.warning("node %s: heartbeat failed, registering again: %s", self.node_id, error)
                return
            self.heartbeats += 1
            if response.reregister:
                log.info("scheduler asks node %s to register again", self.node_id)
                return
            if response.stop_worker_ids:
                self._unwanted(response.stop_worker_ids)
