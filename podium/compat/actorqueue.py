"""``ray.util.queue``: a first-in first-out queue held by an actor, usable from any process.

``Queue(maxsize=0, actor_options=None)`` starts one actor that holds an ``asyncio.Queue``;
the ``Queue`` object only holds that actor's handle, so it pickles into a task's or another
actor's arguments and works there too (the handle travels). The API is Ray 2.x's:
``put``/``get`` with ``block`` and ``timeout``, ``put_nowait``/``get_nowait``,
``put_nowait_batch``/``get_nowait_batch``, ``put_async``/``get_async`` (awaitable on any event
loop), ``qsize``/``size``/``len``, ``empty``, ``full``, ``shutdown``. A queue that is empty or
full raises :class:`Empty` / :class:`Full`, subclasses of the standard library's
``queue.Empty`` / ``queue.Full`` as in Ray. Every method of the actor is ``async`` so the
queue is only touched on the actor's event loop.
"""

from __future__ import annotations

import asyncio
import queue as _stdlib_queue
from collections.abc import Iterable
from typing import Any

from podium.errors import ArgumentMismatchError, InvalidArgumentError

__all__ = ["Queue", "Empty", "Full", "MAX_BATCH"]

#: Most items one ``put_nowait_batch`` / ``get_nowait_batch`` moves.
MAX_BATCH = 1_000_000


class Empty(_stdlib_queue.Empty):
    """The queue had no item in time (``get`` with ``block=False`` or a timeout)."""


class Full(_stdlib_queue.Full):
    """The queue had no room in time (``put`` with ``block=False`` or a timeout)."""


# The actor answers ("ok", value) or ("empty" | "full", message): an outcome, not an exception,
# so the caller raises Empty / Full here, whatever the error path in between does.
_OK, _EMPTY, _FULL = "ok", "empty", "full"


class _QueueActor:
    """The actor that holds the items."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self.items: asyncio.Queue | None = None

    def _queue(self) -> asyncio.Queue:
        if self.items is None:  # made on the actor's loop, where every method runs
            self.items = asyncio.Queue(self.maxsize)
        return self.items

    async def qsize(self) -> int:
        return self._queue().qsize()

    async def empty(self) -> bool:
        return self._queue().empty()

    async def full(self) -> bool:
        return self._queue().full()

    async def put(self, item: Any, timeout: float | None = None) -> tuple[str, Any]:
        try:
            await asyncio.wait_for(self._queue().put(item), timeout)
        except asyncio.TimeoutError:
            return _FULL, f"the queue stayed full (maxsize {self.maxsize}) for {timeout} s"
        return _OK, None

    async def get(self, timeout: float | None = None) -> tuple[str, Any]:
        try:
            return _OK, await asyncio.wait_for(self._queue().get(), timeout)
        except asyncio.TimeoutError:
            return _EMPTY, f"the queue stayed empty for {timeout} s"

    async def put_nowait(self, item: Any) -> tuple[str, Any]:
        try:
            self._queue().put_nowait(item)
        except asyncio.QueueFull:
            return _FULL, f"the queue is full (maxsize {self.maxsize})"
        return _OK, None

    async def put_nowait_batch(self, items: list) -> tuple[str, Any]:
        q = self._queue()
        if self.maxsize > 0 and q.qsize() + len(items) > self.maxsize:
            return _FULL, (f"cannot add {len(items)} items to a queue holding {q.qsize()} "
                           f"with maxsize {self.maxsize}")
        for item in items:
            q.put_nowait(item)
        return _OK, None

    async def get_nowait(self) -> tuple[str, Any]:
        try:
            return _OK, self._queue().get_nowait()
        except asyncio.QueueEmpty:
            return _EMPTY, "the queue is empty"

    async def get_nowait_batch(self, count: int) -> tuple[str, Any]:
        q = self._queue()
        if count > q.qsize():
            return _EMPTY, f"cannot get {count} items from a queue holding {q.qsize()}"
        return _OK, [q.get_nowait() for _ in range(count)]


def _outcome(answer: tuple[str, Any]) -> Any:
    kind, value = answer
    if kind == _EMPTY:
        raise Empty(value)
    if kind == _FULL:
        raise Full(value)
    return value


def _timeout(block: bool, timeout: float | None) -> float | None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout < 0):
        raise InvalidArgumentError(f"'timeout' must be a non-negative number or None, got {timeout!r}")
    return timeout if block else None


class Queue:
    """Ray's ``ray.util.queue.Queue`` (see the module docstring)."""

    def __init__(self, maxsize: int = 0, hint_ip: str | None = None, actor_options: dict | None = None) -> None:
        from podium.compat.standin import remote

        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
            raise InvalidArgumentError(f"maxsize must be an int >= 0 (0: no limit), got {maxsize!r}")
        if hint_ip is not None:
            raise InvalidArgumentError("Queue(hint_ip=...) is not supported by Podium: give "
                                       "actor_options={'scheduling_strategy': NodeAffinitySchedulingStrategy(...)}")
        self.maxsize = maxsize
        self.actor = remote(_QueueActor).options(**(actor_options or {})).remote(maxsize)

    def _get(self, ref: Any) -> Any:
        from podium.compat.ray import get

        if self.actor is None:
            raise InvalidArgumentError("this queue was shut down")
        return get(ref)

    def __len__(self) -> int:
        return self.size()

    def size(self) -> int:
        """How many items the queue holds."""
        return self._get(self._actor().qsize.remote())

    def qsize(self) -> int:
        """How many items the queue holds."""
        return self.size()

    def empty(self) -> bool:
        """Whether the queue holds no item."""
        return self._get(self._actor().empty.remote())

    def full(self) -> bool:
        """Whether the queue holds ``maxsize`` items (never, for maxsize 0)."""
        return self._get(self._actor().full.remote())

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """Add ``item``; waits for room (up to ``timeout`` s) unless ``block`` is False; Full."""
        timeout = _timeout(block, timeout)
        method = self._actor().put if block else self._actor().put_nowait
        _outcome(self._get(method.remote(item, timeout) if block else method.remote(item)))

    async def put_async(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """:meth:`put`, awaited (the caller's event loop stays free)."""
        timeout = _timeout(block, timeout)
        actor = self._actor()
        _outcome(await (actor.put.remote(item, timeout) if block else actor.put_nowait.remote(item)))

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Take the oldest item; waits for one (up to ``timeout`` s) unless ``block`` is False; Empty."""
        timeout = _timeout(block, timeout)
        actor = self._actor()
        return _outcome(self._get(actor.get.remote(timeout) if block else actor.get_nowait.remote()))

    async def get_async(self, block: bool = True, timeout: float | None = None) -> Any:
        """:meth:`get`, awaited (the caller's event loop stays free)."""
        timeout = _timeout(block, timeout)
        actor = self._actor()
        return _outcome(await (actor.get.remote(timeout) if block else actor.get_nowait.remote()))

    def put_nowait(self, item: Any) -> None:
        """``put(item, block=False)``."""
        self.put(item, block=False)

    def put_nowait_batch(self, items: Iterable) -> None:
        """Add every item at once, or none (Full when they do not all fit)."""
        if not isinstance(items, Iterable):
            raise ArgumentMismatchError("Argument 'items' must be an Iterable")
        items = list(items)
        if len(items) > MAX_BATCH:
            raise InvalidArgumentError(f"put_nowait_batch takes at most {MAX_BATCH} items, got {len(items)}")
        _outcome(self._get(self._actor().put_nowait_batch.remote(items)))

    def get_nowait(self) -> Any:
        """``get(block=False)``."""
        return self.get(block=False)

    def get_nowait_batch(self, num_items: int) -> list:
        """Take ``num_items`` items at once, or none (Empty when it holds fewer)."""
        if isinstance(num_items, bool) or not isinstance(num_items, int):
            raise ArgumentMismatchError("Argument 'num_items' must be an int")
        if not 0 <= num_items <= MAX_BATCH:
            raise InvalidArgumentError(f"'num_items' must be in [0, {MAX_BATCH}], got {num_items}")
        return _outcome(self._get(self._actor().get_nowait_batch.remote(num_items)))

    def shutdown(self, force: bool = False, grace_period_s: int = 5) -> None:
        """Stop the queue's actor (its items are lost); the queue is unusable afterwards. Podium
        stops it at once either way (its calls in flight fail)."""
        from podium.compat.ray import kill

        if self.actor is not None:
            kill(self.actor)
        self.actor = None

    def _actor(self) -> Any:
        if self.actor is None:
            raise InvalidArgumentError("this queue was shut down")
        return self.actor
