"""Releasing held results in batches: one Release RPC per worker per event-loop turn.

A ``blocking=False`` call leaves each rank's result in its worker until the controller's
handle to it is garbage collected. Releasing each one with its own RPC costs as much as
the call did; handles die in bunches (a list of refs going out of scope), so ids are
queued from any thread and sent together.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

__all__ = ["Releaser", "releaser_for"]

_releasers: "weakref.WeakKeyDictionary[Any, Releaser]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class Releaser:
    """Collects (worker client, object id) pairs and releases them per client in one RPC."""

    def __init__(self, runtime: Any) -> None:
        self._rt = runtime
        self._lock = threading.Lock()
        self._queued: dict[Any, list[str]] = {}
        self._scheduled = False

    def add(self, client: Any, object_id: str) -> None:
        """Queue one held result for release (from any thread)."""
        with self._lock:
            self._queued.setdefault(client, []).append(object_id)
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._rt.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            queued, self._queued = self._queued, {}
            self._scheduled = False
        if self._rt._closed:
            return
        for client, ids in queued.items():
            self._rt.loop.create_task(self._send(client, ids))

    async def _send(self, client: Any, ids: list[str]) -> None:
        with contextlib.suppress(Exception):  # a gone worker holds nothing any more
            released = await client.release(ids)
            self._rt.stats["released"] = self._rt.stats.get("released", 0) + released


def releaser_for(runtime: Any) -> Releaser:
    """The runtime's releaser (made on first use)."""
    with _lock:
        releaser = _releasers.get(runtime)
        if releaser is None:
            releaser = _releasers[runtime] = Releaser(runtime)
        return releaser
