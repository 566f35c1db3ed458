"""What a worker process hosts for a single actor with ``max_concurrency`` (Ray's threaded
and async actors), and for the pool workers that run remote functions (tasks).

A worker runs synchronous methods one at a time on its execution thread and ``async def``
methods concurrently on its loop. :class:`ActorShell` wraps the user's object to change
that as Ray's ``max_concurrency`` does: synchronous methods run on a pool of that many
threads (so up to that many at once, in no guaranteed order) and async methods at most
that many at once. :class:`TaskRunner` is the hosted object of a task worker.
:func:`construct` builds an actor's object, awaiting an ``async def __init__`` on the worker's
loop (as Ray does; OpenRLHF's actors have one).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
from typing import Any, Callable

from podium.errors import FailedPreconditionError

__all__ = ["ActorShell", "TaskRunner", "MAX_CONCURRENCY", "construct", "set_host_loop"]

#: Largest ``max_concurrency`` accepted (threads in one worker, or concurrent coroutines).
MAX_CONCURRENCY = 10_000

#: The event loop of this worker process's host (its async methods run there), once set.
_host_loop: asyncio.AbstractEventLoop | None = None


def set_host_loop(loop: asyncio.AbstractEventLoop | None) -> None:
    """Name the loop an ``async def __init__`` runs on (the worker host sets its own)."""
    global _host_loop
    _host_loop = loop


def construct(cls: type, args: tuple, kwargs: dict) -> Any:
    """``cls(*args, **kwargs)``; when ``cls.__init__`` is ``async def``, the object is made
    with ``__new__`` and its ``__init__`` awaited on the host's loop, so what it starts there
    (tasks, locks, clients) belongs to the loop that later runs the actor's async methods.
    Called on the execution thread, which may block: the loop is free meanwhile."""
    init = getattr(cls, "__init__", None)
    if not inspect.iscoroutinefunction(init):
        return cls(*args, **kwargs)
    new: Any = cls.__new__
    obj = new(cls) if new is object.__new__ else new(cls, *args, **kwargs)
    loop = _host_loop
    if loop is None or loop.is_closed():
        asyncio.run(init(obj, *args, **kwargs))  # no host here (a test): a loop of its own
        return obj
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:  # on the loop itself a blocking wait would never end
        raise FailedPreconditionError(f"{cls.__qualname__} has an async __init__ but is built on the worker's "
                                      "event loop, where awaiting it would block that loop")
    asyncio.run_coroutine_threadsafe(init(obj, *args, **kwargs), loop).result()
    return obj


class ActorShell:
    """Hosts ``cls(*args, **kwargs)`` with at most ``max_concurrency`` calls running at once."""

    def __init__(self, cls: type, max_concurrency: int, args: tuple, kwargs: dict) -> None:
        self._podium_actor = construct(cls, args, kwargs)
        self._podium_limit = max_concurrency
        self._podium_threads = concurrent.futures.ThreadPoolExecutor(
            max_concurrency, thread_name_prefix="podium-actor")
        self._podium_semaphore: asyncio.Semaphore | None = None
        self._podium_wrapped: dict[str, Callable] = {}

    def _podium_gate(self) -> asyncio.Semaphore:
        # Made on first use, on the worker's loop (where every wrapper below runs).
        if self._podium_semaphore is None:
            self._podium_semaphore = asyncio.Semaphore(self._podium_limit)
        return self._podium_semaphore

    def __getattr__(self, name: str) -> Any:
        # Only names the shell lacks reach here: the user's methods and attributes.
        if name.startswith("_podium_"):
            raise AttributeError(name)
        value = getattr(self._podium_actor, name)
        if name.startswith("__") or not callable(value):
            return value
        wrapped = self._podium_wrapped.get(name)
        if wrapped is None:
            wrapped = self._podium_wrapped[name] = self._wrap(value)
        return wrapped

    def _wrap(self, fn: Callable) -> Callable:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def limited(*args: Any, **kwargs: Any) -> Any:
                async with self._podium_gate():
                    return await fn(*args, **kwargs)
            return limited

        @functools.wraps(fn)
        async def threaded(*args: Any, **kwargs: Any) -> Any:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._podium_threads, functools.partial(fn, *args, **kwargs))
        return threaded


class TaskRunner:
    """A task worker's object: runs the function it is sent (a remote function's body)."""

    def run(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the execution thread."""
        return fn(*args, **kwargs)

    async def run_async(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
        """``await fn(*args, **kwargs)`` on the worker's loop (an ``async def`` remote function)."""
        return await fn(*args, **kwargs)
