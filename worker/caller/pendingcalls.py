"""The calls a :class:`~podium.worker.caller.client.WorkerClient` has sent and not yet seen answered.

Each call waits as a :class:`PendingCall` (an asyncio future, or a "sink" that a burst of
``blocking=False`` calls settles without a future per call). :class:`PendingCalls` keeps them
by call id and gives them deadlines with one timer per client, armed at the earliest: a burst's
calls share a timeout, so arming happens for the first call only.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any, Protocol

from podium.transport import chunks

__all__ = ["PendingCall", "PendingCalls", "Sink"]


class Sink(Protocol):
    """Where the outcome of one call lands without a future of its own (``submit_into``): a
    pending result of a ``blocking=False`` call, one rank's slot of a group call. Settled once;
    a later outcome is dropped."""

    def done(self) -> bool:
        """Whether the outcome has arrived (or nobody wants it any more)."""

    def set_result(self, value: Any) -> Any:
        """Settle with the call's value."""

    def set_exception(self, exc: BaseException) -> Any:
        """Settle with the call's error."""


class PendingCall:
    """One call waiting for its reply: an asyncio future, or a sink (see ``submit_into``)."""

    __slots__ = ("future", "sink", "on_error", "method", "assembler", "deadline", "timeout", "shm_name",
                 "shm_pooled", "staged", "decode")

    def __init__(self, future: asyncio.Future | None, method: str) -> None:
        self.future = future
        #: With ``future`` None: settled by ``sink.set_result(value)`` or ``on_error(sink, exc)``.
        self.sink: Sink = None  # type: ignore[assignment]
        self.on_error: Callable[[Sink, BaseException], Any] = None  # type: ignore[assignment]
        self.method = method
        self.assembler: chunks.Assembler | None = None
        #: loop.time() by which the call must have answered (0: none).
        self.deadline = 0.0
        self.timeout: float | None = None
        #: The call's argument segment: unlinked by the worker when it maps it, by the client
        #: when the call ends otherwise (a worker that died never maps it).
        self.shm_name = ""
        #: shm_name is a segment of the client's pool (podium.transport.shmpool), not a one-shot one.
        self.shm_pooled = False
        #: The group call's staged segment this call carries (podium.transport.shmstage), pinned
        #: until the reply is decoded.
        self.staged = ""
        #: Resolve with the decoded value (submit) rather than the raw reply.
        self.decode = False

    def done(self) -> bool:
        """Whether the outcome has been delivered (or the awaiting caller went away)."""
        return self.future.done() if self.future is not None else self.sink.done()

    def resolve(self, value: Any, exc: BaseException | None) -> None:
        """Deliver the outcome (once; later ones are dropped)."""
        future = self.future
        if future is not None:
            if future.done():
                return
            if exc is None:
                future.set_result(value)
            else:
                future.set_exception(exc)
        elif exc is None:
            self.sink.set_result(value)
        else:
            self.on_error(self.sink, exc)


class PendingCalls(dict):
    """``call id -> PendingCall``, with fresh call ids and one deadline timer for all.

    ``expire(call_id)`` is called (on the client's loop) for each call past its deadline.
    """

    def __init__(self, expire: Callable[[int], None]) -> None:
        super().__init__()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expire = expire
        self._ids = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        #: Called (no arguments) whenever every pending call is taken, which the client does
        #: when its calls break, after it recorded why: an actor's owner restarts it then.
        self.on_take_all: Callable[[], Any] | None = None

    def add(self, p: PendingCall, timeout: float | None) -> int:
        """Register ``p`` under a new call id (with a deadline ``timeout`` seconds from now)."""
        call_id = next(self._ids)
        if timeout is not None:
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            deadline = p.deadline = loop.time() + timeout
            p.timeout = timeout
            if self._timer is None or deadline < self._timer_at:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer_at = deadline
                self._timer = loop.call_at(deadline, self._sweep)
        self[call_id] = p
        return call_id

    def _sweep(self) -> None:
        """Expire every call past its deadline; re-arm for the earliest one left."""
        self._timer = None
        assert self._loop is not None  # armed by add()
        now = self._loop.time()
        earliest = 0.0
        for call_id, p in list(self.items()):
            if not p.deadline:
                continue
            if p.deadline <= now:
                self._expire(call_id)
            elif not earliest or p.deadline < earliest:
                earliest = p.deadline
        if earliest:
            self._timer_at = earliest
            self._timer = self._loop.call_at(earliest, self._sweep)

    def take_all(self) -> list[PendingCall]:
        """Remove and return every pending call (:attr:`on_take_all` first)."""
        if self.on_take_all is not None:
            self.on_take_all()
        calls = list(self.values())
        self.clear()
        return calls

    def stop(self) -> None:
        """Cancel the deadline timer (the client is closing)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
