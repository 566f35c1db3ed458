"""A node's link to the scheduler: register, heartbeat, register again, back off.

:class:`SchedulerLink` is the loop every node agent runs (:mod:`podium.worker.agent.service`),
written once: register the node; heartbeat at the interval the scheduler answers with; when a
heartbeat fails or the scheduler asks, register again; while the scheduler cannot be reached,
retry with a backoff that doubles up to :data:`MAX_BACKOFF_SECONDS` (and, once registered, up
to the heartbeat interval: a restarted scheduler must hear from the node well within the node
lease it restores). It knows no gRPC: it is given the two calls, so a load-test harness can
drive many of them with simulated nodes over shared connections.

Fencing. A node cut off from the scheduler keeps running; the scheduler declares it dead once
its lease (``lease_seconds`` of the registration) passes without a heartbeat, and may then
place its ranks elsewhere. So that no rank ever has two live copies, the link fences the
node first: when ``lease - margin`` seconds (:func:`fence_margin`) have passed since the
*sending* of the last heartbeat (or registration) the scheduler answered, it calls
``fence()``, which kills every worker of the node. The scheduler cannot have heard from the
node later than that sending, so the fence lands at least ``margin`` before the scheduler's
lease can run out. A scheduler that is known not to be running (its port refuses the
connection) restarts every lease when it comes back (``ClusterModel.restore``), so a refusal
restarts the count: a scheduler restart never fences a node. docs/architecture.md ("Leases
and fencing") has the timeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from podium import errors
from podium.v1 import scheduler_pb2

log = logging.getLogger(__name__)

__all__ = ["SchedulerLink", "MAX_BACKOFF_SECONDS", "DEFAULT_HEARTBEAT_SECONDS", "RETRYABLE", "fence_margin",
           "scheduler_is_down"]

#: Heartbeat interval when the scheduler does not say.
DEFAULT_HEARTBEAT_SECONDS = 2.0
#: Retry delays towards an unreachable scheduler grow up to this.
MAX_BACKOFF_SECONDS = 5.0
#: First retry delay after a failed registration.
FIRST_BACKOFF_SECONDS = 0.1
#: Errors worth retrying: the scheduler is down or slow, not the request wrong.
RETRYABLE = (errors.UnavailableError, errors.DeadlineExceededError, errors.CancelledError)


def fence_margin(lease: float, interval: float) -> float:
    """How long before its lease could run out a cut-off node fences itself: one heartbeat
    interval, and at least a fifth of the lease (a slow kill, a loaded machine)."""
    return max(interval, lease / 5)


def scheduler_is_down(error: BaseException) -> bool:
    """Whether a failed call proves the scheduler is not running: its address answered and
    refused the connection (a stopped or cut-off scheduler times out instead)."""
    return isinstance(error, errors.UnavailableError) and "refused" in str(error).lower()


class SchedulerLink:
    """One node's registration and heartbeats, until ``stop`` is set.

    ``register()`` sends RegisterNode (what the node is and runs) and ``beat()`` one
    heartbeat; both raise :mod:`podium.errors` on failure. ``unwanted(ids)`` is told the
    workers the scheduler no longer wants. ``jitter()``, when given, scales each retry delay
    (0.5 + a random fraction: many nodes retrying together do not stay in step);
    ``spread()``, when given, delays the first heartbeat by that fraction of an interval
    (machines started together do not all beat at one instant). ``fence()``, when given,
    kills the node's workers (see the module docstring) and returns how many it killed;
    ``renewed(deadline)``, when given, is told each new fence deadline (``time.monotonic()``),
    so the fork server can fence re-adoptable workers by it if the agent itself dies.
    """

    def __init__(self, node_id: str, *,
                 register: Callable[[], Awaitable[scheduler_pb2.RegisterNodeResponse]],
                 beat: Callable[[], Awaitable[scheduler_pb2.HeartbeatResponse]],
                 unwanted: Callable[[Sequence[str]], None],
                 stop: asyncio.Event | None = None,
                 jitter: Callable[[], float] | None = None,
                 spread: Callable[[], float] | None = None,
                 fence: Callable[[], int] | None = None,
                 renewed: Callable[[float], None] | None = None,
                 scheduler: str = "") -> None:
        self.node_id = node_id
        self._register = register
        self._beat = beat
        self._unwanted = unwanted
        self.stop = stop if stop is not None else asyncio.Event()
        self._jitter = jitter
        self._spread = spread
        self._fence = fence
        self._on_renewed = renewed
        self._scheduler = scheduler
        #: The node lease the scheduler granted at registration (0: not known yet).
        self.lease = 0.0
        #: The heartbeat interval the scheduler asked for.
        self.interval = DEFAULT_HEARTBEAT_SECONDS
        #: Times the node fenced itself.
        self.fences = 0
        # When the last call the scheduler answered was sent (time.monotonic()), or None.
        self._renewed_at: float | None = None
        # A previous agent's fence deadline for the workers this one re-adopted: it holds
        # until this agent's own first renewal.
        self._inherited: float | None = None
        self._renewal = asyncio.Event()
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
        watch = asyncio.get_running_loop().create_task(self._fence_watch()) if self._fence else None
        try:
            await self._run()
        finally:
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch

    def inherit_fence(self, deadline: float | None) -> None:
        """Fence by ``deadline`` (``time.monotonic()``) unless the scheduler renews the lease
        first: the fence deadline of the previous agent whose workers this one re-adopted."""
        if deadline is not None and self._renewed_at is None:
            self._inherited = deadline
            self._renewal.set()

    def fence_deadline(self) -> float | None:
        """When the node fences itself unless the scheduler answers before (None: no lease)."""
        if self._renewed_at is not None and self.lease > 0:
            return self._renewed_at + self.lease - fence_margin(self.lease, self.interval)
        return self._inherited

    def _renewed(self, sent_at: float) -> None:
        """The scheduler answered a call sent at ``sent_at``: the lease runs from there."""
        self._renewed_at = sent_at
        self._renewal.set()
        deadline = self.fence_deadline()
        if self._on_renewed is not None and deadline is not None:
            self._on_renewed(deadline)

    def _failed(self, error: BaseException) -> None:
        if not scheduler_is_down(error):
            return
        if self._renewed_at is not None:
            self._renewed(time.monotonic())  # it restarts every lease when it is back
        elif self._inherited is not None:
            self._inherited = None  # likewise: the restarted scheduler counts anew
            self._renewal.set()

    async def _fence_watch(self) -> None:
        """Fence the node when its lease could run out before a heartbeat gets through."""
        fence = self._fence
        if fence is None:
            return
        fenced_at: float | None = None  # the deadline the last fence answered
        while True:
            deadline = self.fence_deadline()
            if deadline is None or deadline == fenced_at:
                await self._renewal.wait()
                self._renewal.clear()
                continue
            delay = deadline - time.monotonic()
            if delay > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._renewal.wait(), delay)
                self._renewal.clear()
                continue
            fenced_at = deadline
            self.fences += 1
            killed = fence()
            log.error("node %s could not renew its %g s lease in time: fenced %.1f s past the deadline, "
                      "killed its %d worker(s) before the scheduler can place their ranks elsewhere",
                      self.node_id, self.lease, time.monotonic() - deadline, killed)

    async def _run(self) -> None:
        backoff, outage_logged = FIRST_BACKOFF_SECONDS, False
        max_backoff = MAX_BACKOFF_SECONDS
        while not self.stop.is_set():
            sent_at = time.monotonic()
            try:
                response = await self._register()
            except errors.PodiumError as error:
                self._failed(error)
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
            self.lease = response.lease_seconds
            self.interval = response.heartbeat_interval_seconds or DEFAULT_HEARTBEAT_SECONDS
            self._renewed(sent_at)
            self.scheduler_id = response.scheduler_id
            first = self.registrations == 0
            self.registrations += 1
            self.registered.set()
            interval = self.interval
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
            sent_at = time.monotonic()
            try:
                response = await self._beat()
            except errors.PodiumError as error:
                self._failed(error)
                log.warning("node %s: heartbeat failed, registering again: %s", self.node_id, error)
                return
            self._renewed(sent_at)
            self.heartbeats += 1
            if response.reregister:
                log.info("scheduler asks node %s to register again", self.node_id)
                return
            if response.stop_worker_ids:
                self._unwanted(response.stop_worker_ids)
