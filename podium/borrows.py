"""Refs that other processes keep: Ray's borrowers, counted by each value's owner.

A ref that arrives in a process other than its owner's (inside a call's arguments, a
result, a constructor's arguments) is a ``podium.refs.BorrowedRef``. While any copy of it lives, the
process counts one *borrow* of the value at its owner (``ReleaseRequest.borrow``); when the
last copy is gone it gives the borrow back (``unborrow``). The owner drops a value when it
no longer names it itself *and* no borrow is left (:class:`podium.worker.host.heldstore.HeldStore`).

When the owner learns of a borrow matters: the caller that passed a ref keeps it alive
only until its call is answered. So, as in Ray (a borrower reports the refs it still holds
with its task's reply), a worker settles its borrows before a reply leaves it
(:meth:`Borrows.settle`, called by the worker host while :attr:`Borrows.busy`): a ref the
method kept is counted at its owner before its caller can let go of it, and a ref the method
only read (a top-level argument it fetched, a ``DataProtoFuture``) is borrowed and given back
within the same settling, which sends no message at all. Outside calls (refs received in
results, by the driver) borrows go out :data:`FLUSH_SECONDS` after the first of a batch.

Events are queued from any thread (finalizers run wherever the last reference goes) and
counted under one lock that nothing else takes while it is held; each owner's messages go
out in order, one after another.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
from typing import Any

from podium.limits import MAX_REPEATED

__all__ = ["BORROWS", "Borrows", "FLUSH_SECONDS"]

log = logging.getLogger("podium.borrows")

#: How long borrows made outside a call wait to go out in one batch (a borrow given back
#: meanwhile never goes).
FLUSH_SECONDS = 0.5


class Borrows:
    """The borrows of one process, by (owner address, object id)."""

    def __init__(self) -> None:
        #: Borrows made and given back, not yet counted (any thread appends).
        self.events: collections.deque = collections.deque()
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.RLock()  # (a done callback may run at once, inside _send)
        self._armed = False
        #: The last message to each owner still in flight (the next one waits for it). A hot
        #: path reads ``BORROWS.events or BORROWS.sending`` for :attr:`busy`: no call.
        self.sending: dict[str, concurrent.futures.Future] = {}
        #: Borrows sent and given back (tests and stats read them).
        self.sent = {"borrow": 0, "unborrow": 0}

    @property
    def busy(self) -> bool:
        """Whether a borrow or its return is not yet known to its owner (a reply waits: see
        :meth:`settle`)."""
        return bool(self.events) or bool(self.sending)

    def add(self, owner: str, object_id: str, resolver: Any) -> None:
        """A borrowed ref was made, to be counted through ``resolver`` (a ``podium.refs``
        resolver with ``loop``, ``owns`` and ``send_borrows``); any thread."""
        self.events.append((owner, object_id, 1, resolver))
        self._arm(resolver)

    def drop(self, owner: str, object_id: str, resolver: Any) -> None:
        """A borrowed ref is gone (any thread, a finalizer)."""
        self.events.append((owner, object_id, -1, resolver))
        self._arm(resolver)

    def _arm(self, resolver: Any) -> None:
        if self._armed:
            return
        self._armed = True
        loop = resolver.loop
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
            loop.call_soon_threadsafe(loop.call_later, FLUSH_SECONDS, self.flush)

    def flush(self) -> list[concurrent.futures.Future]:
        """Count the queued events and send what changed, per owner (any thread); the
        messages sent."""
        self._armed = False
        changes: dict[tuple[str, str], int] = {}
        resolvers: dict[str, Any] = {}
        with self._lock:
            counts = self._counts
            events = self.events
            while events:
                owner, object_id, delta, resolver = events.popleft()
                resolvers[owner] = resolver
                key = (owner, object_id)
                before = counts.get(key, 0)
                after = before + delta
                if after > 0:
                    counts[key] = after
                else:
                    counts.pop(key, None)
                if (before > 0) != (after > 0):
                    changes[key] = changes.get(key, 0) + (1 if after > 0 else -1)
            per_owner: dict[str, tuple[list[str], list[str]]] = {}
            for (owner, object_id), change in changes.items():
                if change:
                    borrow, unborrow = per_owner.setdefault(owner, ([], []))
                    (borrow if change > 0 else unborrow).append(object_id)
            sent = []
            for owner, (borrow, unborrow) in per_owner.items():
                for start in range(0, max(len(borrow), len(unborrow)), MAX_REPEATED):
                    part = (borrow[start:start + MAX_REPEATED], unborrow[start:start + MAX_REPEATED])
                    self.sent["borrow"] += len(part[0])
                    self.sent["unborrow"] += len(part[1])
                    with contextlib.suppress(RuntimeError):  # its loop is closed: the process is ending
                        sent.append(self._send(resolvers[owner], owner, *part))
        return sent

    def _send(self, resolver: Any, owner: str, borrow: list[str], unborrow: list[str]) -> concurrent.futures.Future:
        # One owner's messages go one after another: a borrow given back must not reach
        # the owner before the borrow itself. (Under self._lock.)
        before = self.sending.get(owner)
        future = asyncio.run_coroutine_threadsafe(_send(before, resolver, owner, borrow, unborrow), resolver.loop)
        self.sending[owner] = future

        def done(_: Any) -> None:
            with self._lock:
                if self.sending.get(owner) is future:
                    del self.sending[owner]
        future.add_done_callback(done)
        return future

    async def settle(self) -> None:
        """Send what is queued and wait until every message in flight reached its owner (or
        failed: an owner gone holds nothing any more). A worker awaits this before a reply
        leaves while :attr:`busy`."""
        self.flush()
        with self._lock:
            waiting = list(self.sending.values())
        if waiting:
            await asyncio.wait([asyncio.wrap_future(f) for f in waiting])


async def _send(before: concurrent.futures.Future | None, resolver: Any, owner: str, borrow: list[str],
                unborrow: list[str]) -> None:
    if before is not None:
        await asyncio.wait([asyncio.wrap_future(before)])
    try:
        await resolver.send_borrows(owner, borrow, unborrow)
    except Exception as exc:  # noqa: BLE001 - an owner gone holds nothing any more
        log.debug("borrows to %s not delivered: %s", owner, exc)


#: This process's borrows.
BORROWS = Borrows()
