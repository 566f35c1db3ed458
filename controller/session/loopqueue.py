"""Hand many small jobs to the runtime's event-loop thread with one wake-up.

``asyncio.run_coroutine_threadsafe`` costs a Task, two chained futures and a wake-up of the
loop per call; a script issuing thousands of ``blocking=False`` calls pays that for each.
:func:`soon` queues a plain callable instead and wakes the loop only when the queue was
empty, so a burst of calls is started in one loop turn.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import weakref
from typing import Any, Callable

__all__ = ["soon"]

log = logging.getLogger("podium.controller")


class _Queue:
    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.jobs: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.scheduled = False

    def put(self, fn: Callable, args: tuple) -> None:
        with self.lock:
            self.jobs.append((fn, args))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self.run)

    def run(self) -> None:
        with self.lock:
            self.scheduled = False
        jobs = self.jobs
        while jobs:
            fn, args = jobs.popleft()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a job reports its own errors; never stop the rest
                log.exception("controller loop job %r failed", fn)


_queues: "weakref.WeakKeyDictionary[Any, _Queue]" = weakref.WeakKeyDictionary()
_queues_lock = threading.Lock()


def soon(loop: Any, fn: Callable, *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop``'s thread soon, in the order queued (from any thread).

    ``fn`` must not raise for its caller to notice: it reports through its own futures.
    """
    queue = _queues.get(loop)
    if queue is None:
        with _queues_lock:
            queue = _queues.get(loop)
            if queue is None:
                queue = _queues[loop] = _Queue(loop)
    with contextlib.suppress(RuntimeError):  # a closed loop: the runtime is shutting down
        queue.put(fn, args)
