"""Releasing held results in batches: one Release RPC per worker per event-loop turn.

A ``blocking=False`` call leaves each rank's result in its worker until the controller's
handle to it is garbage collected. Releasing each one with its own RPC costs as much as
the call did; handles die in bunches (a list of refs going out of scope), so ids are
queued from any thread and sent together.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any

__all__ = ["Releaser"]

class Releaser:
    """Collects (worker client, object id) pairs and releases them per client in one RPC."""

    def __init__(self, runtime: Any) -> None:
        self._rt = runtime
        # A deque, not a lock: add() runs from PendingRef.__del__, which the cyclic
        # collector may call in any thread at any allocation, also inside add() itself.
        self._queued: collections.deque = collections.deque()
        self._scheduled = False

    def add(self, client: Any, object_id: str) -> None:
        """Queue one held result for release (from any thread, also from a finalizer)."""
        self._queued.append((client, object_id))
        if self._scheduled:
            return  # the flush to come takes it: it clears the flag before it drains
        self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._rt.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        queued = self._queued
        by_client: dict[Any, list[str]] = {}
        while queued:
            client, object_id = queued.popleft()
            by_client.setdefault(client, []).append(object_id)
        if self._rt._closed:
            return
        for client, ids in by_client.items():
            self._rt.loop.create_task(self._send(client, ids))

    async def _send(self, client: Any, ids: list[str]) -> None:
        with contextlib.suppress(Exception):  # a gone worker holds nothing any more
            released = await client.release(ids)
            self._rt.stats["released"] = self._rt.stats.get("released", 0) + released
