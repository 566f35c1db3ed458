"""What a worker process hosts for a single actor with ``max_concurrency`` (Ray's threaded
and async actors), and for the pool workers that run remote functions (tasks).

A worker runs synchronous methods one at a time on its execution thread and ``async def``
methods concurrently on its loop. :class:`ActorShell` wraps the user's object to change
that as Ray's ``max_concurrency`` does: a threaded actor's synchronous methods run on a pool
of that many threads (so up to that many at once, in no guaranteed order) and an async
actor's methods at most that many at once. With ``concurrency_groups`` (Ray's meaning) each
group has its own limit and its own threads (a threaded actor) or event loop (an async
actor); a method runs in the group
``@ray.method(concurrency_group=...)`` named (:func:`mark_group`), a call may name another
(:meth:`ActorShell._podium_call_in_group`), and every other method runs in the default
group, whose limit is ``max_concurrency``. So a control method in a group of its own
answers while the default group is full. :class:`TaskRunner` is the hosted object of a task worker.

An async actor (one with an ``async def`` method or ``__init__``) runs, as in Ray, each
group's methods on an event loop of that group's own, in a thread of its own, made when the
actor is made (:class:`GroupLoop`; at most :data:`MAX_GROUPS` + 1 per actor); its sync
methods run there too, one at a time, blocking that loop (Ray's ``sync_to_async``). So a
method that blocks its group's loop (``time.sleep`` in ``async def``) stops neither the
methods of another group nor the worker's own I/O loop, which answers the controller's
liveness pings and takes the calls: the actor is busy, not dead. Its ``async def __init__``
runs on the default group's loop, so what it starts there (tasks, locks, clients) belongs to
the loop that later runs the default group's methods; it may take as long as it takes (a
vLLM engine built inside it), as Ray waits for a constructor.
:func:`construct` builds the object of a worker that has no shell, awaiting an
``async def __init__`` on the worker's own loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
from typing import Any, Callable

from podium.errors import FailedPreconditionError, InvalidArgumentError

__all__ = ["ActorShell", "TaskRunner", "MAX_CONCURRENCY", "MAX_GROUPS", "DEFAULT_GROUP", "GROUP_CALL", "READY_CALL",
           "GroupLoop", "check_groups", "check_method_groups", "construct", "group_of", "is_async_class",
           "mark_group", "method_groups", "set_host_loop"]

#: Largest ``max_concurrency`` accepted (threads in one worker, or concurrent coroutines).
MAX_CONCURRENCY = 10_000
#: Most concurrency groups one actor may declare.
MAX_GROUPS = 64
#: The group of every method that names none (its limit is ``max_concurrency``).
DEFAULT_GROUP = "_ray_default"
#: Ray's default limits of the default group: a threaded (sync) actor runs one call at a
#: time, an async actor up to 1000.
_SYNC_DEFAULT, _ASYNC_DEFAULT = 1, 1000
#: Longest group name accepted.
_MAX_GROUP_NAME = 100
#: The method a call that names its concurrency group is sent to (ActorShell._podium_call_in_group).
GROUP_CALL = "_podium_call_in_group"
#: Ray's ``actor.__ray_ready__.remote()``: the worker answers True once the constructor ran
#: (its error if it failed), from its I/O loop; how a caller bounds a constructor's time.
READY_CALL = "__ray_ready__"
#: The attribute ``@ray.method(concurrency_group=...)`` sets on a function.
_GROUP_ATTR = "__ray_concurrency_group__"


def mark_group(fn: Callable, group: str) -> Callable:
    """Put ``fn`` (a method of an actor class) in the concurrency group ``group``
    (``@ray.method(concurrency_group=...)``); InvalidArgumentError for a bad name."""
    setattr(fn, _GROUP_ATTR, _group_name(group, "concurrency_group"))
    return fn


def group_of(fn: Any) -> str | None:
    """The concurrency group ``fn`` was put in, or None."""
    return getattr(fn, _GROUP_ATTR, None)


def method_groups(cls: type) -> dict[str, str]:
    """Method name -> the group ``@ray.method`` put it in, for every such method of ``cls``."""
    found = {}
    for name in dir(cls):
        group = group_of(getattr(cls, name, None))
        if group is not None:
            found[name] = group
    return found


def _group_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name or len(name) > _MAX_GROUP_NAME:
        raise InvalidArgumentError(f"{what} must be a non-empty string of at most {_MAX_GROUP_NAME} "
                                   f"characters, got {name!r}")
    return name


def check_groups(groups: Any) -> dict[str, int]:
    """``concurrency_groups`` checked: at most :data:`MAX_GROUPS` names, each limit an int in
    [1, :data:`MAX_CONCURRENCY`] (InvalidArgumentError otherwise)."""
    if not isinstance(groups, dict):
        raise InvalidArgumentError(f"concurrency_groups must be a dict of group name to limit, got {groups!r}")
    if len(groups) > MAX_GROUPS:
        raise InvalidArgumentError(f"concurrency_groups may name at most {MAX_GROUPS} groups, got {len(groups)}")
    checked = {}
    for name, limit in groups.items():
        _group_name(name, "a concurrency group's name")
        if name == DEFAULT_GROUP:
            raise InvalidArgumentError(f"{DEFAULT_GROUP!r} is the default group: set its limit with max_concurrency")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_CONCURRENCY:
            raise InvalidArgumentError(f"concurrency group {name!r}: its limit must be an int in "
                                       f"[1, {MAX_CONCURRENCY}], got {limit!r}")
        checked[name] = limit
    return checked


def check_method_groups(cls: type, groups: dict[str, int]) -> dict[str, str]:
    """The groups of ``cls``'s methods (:func:`method_groups`), each one of ``groups``
    (InvalidArgumentError naming the method otherwise)."""
    found = method_groups(cls)
    for name, group in found.items():
        if group not in groups:
            known = ", ".join(sorted(groups)) or "none"
            raise InvalidArgumentError(f"{cls.__qualname__}.{name} is in concurrency group {group!r}, which "
                                       f"the actor does not declare (concurrency_groups: {known})")
    return found

#: The event loop of this worker process's host (its async methods run there), once set.
_host_loop: asyncio.AbstractEventLoop | None = None


def set_host_loop(loop: asyncio.AbstractEventLoop | None) -> None:
    """Name the loop an ``async def __init__`` runs on (the worker host sets its own)."""
    global _host_loop
    _host_loop = loop


def is_async_class(cls: type) -> bool:
    """Whether ``cls`` makes an async actor (Ray's rule: an ``async def`` method or ``__init__``)."""
    return any(inspect.iscoroutinefunction(getattr(cls, n, None)) for n in dir(cls)
               if n == "__init__" or not n.startswith("__"))


def construct(cls: type, args: tuple, kwargs: dict, loop: asyncio.AbstractEventLoop | None = None) -> Any:
    """``cls(*args, **kwargs)``; when ``cls.__init__`` is ``async def``, the object is made
    with ``__new__`` and its ``__init__`` awaited on ``loop`` (default: the host's loop), so
    what it starts there (tasks, locks, clients) belongs to the loop that later runs the
    actor's async methods. Called on the execution thread, which may block: the loop is free
    meanwhile."""
    init = getattr(cls, "__init__", None)
    if not inspect.iscoroutinefunction(init):
        return cls(*args, **kwargs)
    new: Any = cls.__new__
    obj = new(cls) if new is object.__new__ else new(cls, *args, **kwargs)
    loop = loop or _host_loop
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


class GroupLoop:
    """One concurrency group's event loop of an async actor, run by a thread of its own (Ray
    gives each group its own loop): coroutines handed to :meth:`run` run there, at most
    ``limit`` at once, and the caller's loop waits for them without being blocked."""

    def __init__(self, name: str, limit: int) -> None:
        self.limit = limit
        self.loop = asyncio.new_event_loop()
        #: Made on the group's loop by the first call (a Semaphore belongs to one loop).
        self._slots: asyncio.Semaphore | None = None
        started = threading.Event()
        self.loop.call_soon(started.set)
        self.thread = threading.Thread(target=self._serve, name=f"podium-loop-{name}", daemon=True)
        self.thread.start()
        started.wait()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    async def run(self, coro: Any) -> Any:
        """Run ``coro`` on this group's loop within its limit and return its value; cancelled
        here, it is cancelled there."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._limited(coro), self.loop))

    async def _limited(self, coro: Any) -> Any:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        async with self._slots:
            return await coro

    def stop(self) -> None:
        """End the loop's thread (a call still running there is abandoned)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread is not threading.current_thread():
            self.thread.join(5.0)


class _Group:
    """One concurrency group: its limit, its threads (made on first use) and, in an async
    actor, its own event loop (:class:`GroupLoop`)."""

    __slots__ = ("limit", "name", "threads", "loop")

    def __init__(self, name: str, limit: int, own_loop: bool = False) -> None:
        self.name = name
        self.limit = limit
        self.threads: concurrent.futures.ThreadPoolExecutor | None = None
        self.loop: GroupLoop | None = GroupLoop(name, limit) if own_loop else None

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self.threads is None:
            self.threads = concurrent.futures.ThreadPoolExecutor(self.limit, thread_name_prefix=f"podium-{self.name}")
        return self.threads

    def stop(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        if self.threads is not None:
            self.threads.shutdown(wait=False)


class ActorShell:
    """Hosts ``cls(*args, **kwargs)`` with at most ``max_concurrency`` calls running at once
    in the default group, and each concurrency group's own limit in that group (see the
    module docstring). ``max_concurrency`` None: Ray's default (1 for a sync actor, 1000 for
    an async one)."""

    def __init__(self, cls: type, max_concurrency: int | None, args: tuple, kwargs: dict,
                 concurrency_groups: dict[str, int] | None = None) -> None:
        groups = check_groups(concurrency_groups or {})
        self._podium_method_groups = check_method_groups(cls, groups)
        is_async = is_async_class(cls)
        if max_concurrency is None:
            max_concurrency = _ASYNC_DEFAULT if is_async else _SYNC_DEFAULT
        # (An async actor's loops are made now, as in Ray: MAX_GROUPS + 1 threads at most.)
        self._podium_groups = {name: _Group(name, limit, is_async) for name, limit in groups.items()}
        self._podium_default = _Group(DEFAULT_GROUP, max_concurrency, is_async)
        self._podium_wrapped: dict[tuple[str, str], Callable] = {}
        default_loop = self._podium_default.loop
        try:
            # An async __init__ runs on the default group's loop: the worker's own loop stays
            # free to answer (liveness) however long it takes or blocks.
            self._podium_actor = construct(cls, args, kwargs, default_loop.loop if default_loop else None)
        except BaseException:
            self._podium_close()
            raise

    def _podium_close(self) -> None:
        """Stop the groups' loops and threads (the worker's process ends them too)."""
        for group in (self._podium_default, *self._podium_groups.values()):
            group.stop()

    def __getattr__(self, name: str) -> Any:
        # Only names the shell lacks reach here: the user's methods and attributes.
        if name.startswith("_podium_"):
            raise AttributeError(name)
        return self._podium_method(name, self._podium_method_groups.get(name))

    def _podium_method(self, name: str, group_name: str | None) -> Any:
        value = getattr(self._podium_actor, name)
        if name.startswith("__") or not callable(value):
            return value
        key = (name, group_name or "")
        wrapped = self._podium_wrapped.get(key)
        if wrapped is None:
            group = self._podium_default if group_name is None else self._podium_groups[group_name]
            wrapped = self._podium_wrapped[key] = self._podium_wrap(value, group)
        return wrapped

    async def _podium_call_in_group(self, group: str, name: str, /, *args: Any, **kwargs: Any) -> Any:
        """``handle.method.options(concurrency_group=group).remote(...)``: this call of
        ``name`` runs in ``group`` instead of the method's own."""
        if group not in self._podium_groups and group != DEFAULT_GROUP:
            known = ", ".join(sorted(self._podium_groups)) or "none"
            raise InvalidArgumentError(f"concurrency group {group!r} is not one of this actor's "
                                       f"(concurrency_groups: {known})")
        if name.startswith(("__", "_podium_")):
            raise InvalidArgumentError(f"{name!r} is not a method that can be called in a concurrency group")
        method = self._podium_method(name, None if group == DEFAULT_GROUP else group)
        if not callable(method):
            raise InvalidArgumentError(f"{name!r} is not a method of the actor")
        return await method(*args, **kwargs)

    async def _podium_stream(self, name: str, group: str | None, drive: Callable[[Any], int],
                             adrive: Callable[[Any], Any]) -> int:
        """A streaming call of ``name`` (``podium.worker.host.itemstreams``) in its concurrency
        group (``group``, or the method's own), which the whole stream counts against: a threaded
        actor's generator is iterated by ``drive(method)`` on one of the group's threads; an
        async actor's by ``adrive(method)`` on the group's loop (a sync generator by
        ``drive``, there too, blocking that loop as its sync methods do)."""
        if group is not None and group not in self._podium_groups and group != DEFAULT_GROUP:
            known = ", ".join(sorted(self._podium_groups)) or "none"
            raise InvalidArgumentError(f"concurrency group {group!r} is not one of this actor's "
                                       f"(concurrency_groups: {known})")
        group = group or self._podium_method_groups.get(name)
        slot = self._podium_default if group in (None, DEFAULT_GROUP) else self._podium_groups[group]
        fn = getattr(self._podium_actor, name)
        if slot.loop is not None:
            if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
                return await slot.loop.run(adrive(fn))
            return await slot.loop.run(_called(drive, (fn,), {}))
        return await asyncio.get_running_loop().run_in_executor(slot.pool(), drive, fn)

    @staticmethod
    def _podium_wrap(fn: Callable, group: _Group) -> Callable:
        if group.loop is not None:  # an async actor: every method runs on its group's loop
            run = group.loop.run
            if inspect.iscoroutinefunction(fn):
                @functools.wraps(fn)
                async def on_group_loop(*args: Any, **kwargs: Any) -> Any:
                    return await run(fn(*args, **kwargs))
                return on_group_loop

            @functools.wraps(fn)
            async def sync_on_group_loop(*args: Any, **kwargs: Any) -> Any:
                # As Ray's sync_to_async: a sync method of an async actor runs on its group's
                # loop, one at a time there, blocking it meanwhile (not on a pool of threads).
                return await run(_called(fn, args, kwargs))
            return sync_on_group_loop

        @functools.wraps(fn)
        async def threaded(*args: Any, **kwargs: Any) -> Any:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(group.pool(), functools.partial(fn, *args, **kwargs))
        return threaded


async def _called(fn: Callable, args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


class TaskRunner:
    """A task worker's object: runs the function it is sent (a remote function's body)."""

    def run(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the execution thread."""
        return fn(*args, **kwargs)

    async def run_async(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
        """``await fn(*args, **kwargs)`` on the worker's loop (an ``async def`` remote function)."""
        return await fn(*args, **kwargs)
