"""Remote functions (Ray's tasks) and ``podium.remote``, the decorator for them and for actors.

``podium.remote(fn).remote(*args)`` runs ``fn(*args)`` in a worker process placed by the
scheduler like any other and returns a ref at once. The workers are a pool per resource
shape (``num_cpus``, ``num_gpus``, env, placement group bundle): a task goes to an idle
worker of its pool, and a new worker is started while every worker is busy and the pool has
fewer than ``PODIUM_TASK_WORKERS`` (default 4, at most 256) workers; otherwise it queues on
the least busy one. Pool workers are reused and stop with the runtime (an idle one in a
placement group bundle stops when an actor needs its room, as a Ray task holds none once it
ended); one that died or
stopped answering leaves its pool, so later tasks start a fresh worker. As in Ray, a task
whose worker died runs again, on another worker, up to ``max_retries`` times (default 3;
-1: no limit; 0: it fails with WorkerDiedError at once), and with ``retry_exceptions`` (True,
or a list of exception classes) a task whose function raised runs again too, within the same
count (:mod:`.actorcalls`). A task that stopped answering is not retried. The function travels
by value when the workers cannot import it; top-level ref arguments are fetched by the
worker, as for any call; a function that raised gives RemoteError with its traceback.
"""

from __future__ import annotations

import inspect
import os
import threading
from typing import Any, Callable

from podium.controller.remote.actoroptions import DEFAULT_TASK_RETRIES, Options, captured, parse_options
from podium.controller.remote.actorplace import SLOT_RECLAIMERS, remove
from podium.controller.remote.actors import ActorClass, ActorHandle, start_actor
from podium.controller.remote.returns import split_returns
from podium.controller.remote.streams import Streaming, stream_call
from podium.errors import (ArgumentMismatchError, InvalidArgumentError, UnimplementedError, UnresponsiveError,
                           WorkerDiedError)
from podium.worker.actorshell import TaskRunner

__all__ = ["RemoteFunction", "remote", "task_pool_limit", "MAX_TASK_WORKERS"]

#: Largest PODIUM_TASK_WORKERS accepted.
MAX_TASK_WORKERS = 256


def task_pool_limit() -> int:
    """Workers per task pool: ``PODIUM_TASK_WORKERS`` (1..256), default 4."""
    text = os.environ.get("PODIUM_TASK_WORKERS", "4")
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgumentError(f"PODIUM_TASK_WORKERS must be an integer, got {text!r}") from None
    if not 1 <= value <= MAX_TASK_WORKERS:
        raise InvalidArgumentError(f"PODIUM_TASK_WORKERS must be in [1, {MAX_TASK_WORKERS}], got {value}")
    return value


class _Pool:
    """The task workers of one resource shape, with their calls in flight."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        #: Each worker and its calls in flight, in start order.
        self.busy: dict[ActorHandle, int] = {}
        self._lock = threading.Lock()
        self._growing = threading.Lock()

    def _take_least_busy(self, any_count: bool) -> ActorHandle | None:
        """Under the lock: the least busy worker, counted busy once more, if it is idle or
        ``any_count`` (the pool is full); None otherwise."""
        if not self.busy:
            return None
        handle = min(self.busy, key=self.busy.__getitem__)
        if self.busy[handle] and not any_count:
            return None
        self.busy[handle] += 1
        return handle

    def pick(self) -> ActorHandle:
        """The worker to run the next task on (starting one when needed)."""
        with self._lock:
            handle = self._take_least_busy(len(self.busy) >= task_pool_limit())
        if handle is not None:
            return handle
        with self._growing:  # one start at a time; others queue on the existing workers
            with self._lock:
                handle = self._take_least_busy(len(self.busy) >= task_pool_limit())
            if handle is not None:
                return handle
            handle = start_actor(TaskRunner, self.opts, (), {})
            with self._lock:
                self.busy[handle] = 1
                return handle

    def take_idle(self, pg_id: str, bundle: int) -> list[ActorHandle]:
        """Take the idle workers placed in ``bundle`` of ``pg_id`` out of the pool."""
        with self._lock:
            idle = [h for h, n in self.busy.items() if not n and h.worker.info.spec.placement_group_id == pg_id
                    and h.worker.info.spec.bundle_index == bundle]
            for handle in idle:
                del self.busy[handle]
        return idle

    def done(self, handle: ActorHandle, error: BaseException | None = None) -> None:
        """A task on ``handle`` finished. If its worker died or stopped answering it leaves
        the pool (its last handle gone, the worker is stopped), so the next task starts a
        fresh one instead of failing on it forever."""
        with self._lock:
            if handle not in self.busy:
                return
            if isinstance(error, (WorkerDiedError, UnresponsiveError)):
                del self.busy[handle]
            else:
                self.busy[handle] -= 1


_pools: dict[tuple, _Pool] = {}
_pools_lock = threading.Lock()


def _pool_for(opts: Options) -> _Pool:
    from podium.controller.session.runtime import get_runtime

    rt = get_runtime()
    pg = opts.placement_group
    key = (rt.session_id, opts.num_cpus, opts.num_gpus, tuple(sorted(opts.resources.items())),
           tuple(sorted(opts.env.items())),
           tuple(sorted(opts.process_env.items())), tuple(sorted(opts.runtime.items())),
           getattr(pg, "id", pg), opts.bundle_index, opts.node, opts.node_soft)
    with _pools_lock:
        for stale in [k for k in _pools if k[0] != rt.session_id]:
            del _pools[stale]  # pools of an earlier runtime: their workers are gone
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = _Pool(opts)
        return pool


async def _reclaim_idle_workers(rt: Any, pg_id: str, bundle: int) -> int:
    """Stop this session's idle task workers in ``bundle`` of ``pg_id``, whose room an actor
    asks for: as in Ray, where a finished task holds none of its bundle (ROLL's resource
    manager runs a ``num_gpus=N`` task in each bundle, then places its actors there)."""
    with _pools_lock:
        pools = [pool for key, pool in _pools.items() if key[0] == rt.session_id]
    idle = [handle for pool in pools for handle in pool.take_idle(pg_id, bundle)]
    for handle in idle:
        await remove(rt, handle._group)
    return len(idle)


SLOT_RECLAIMERS.append(_reclaim_idle_workers)


class RemoteFunction:
    """``podium.remote(fn)``: ``.remote(*args, **kwargs)`` runs ``fn`` in a task worker."""

    def __init__(self, fn: Callable, options: Options | None = None) -> None:
        self._function = fn
        self._options = options or Options()
        self.__name__ = getattr(fn, "__name__", "task")
        self.__doc__ = fn.__doc__

    def options(self, **options: Any) -> "RemoteFunction":
        """A copy with these options on top (Ray's ``.options``: num_cpus, num_gpus, runtime_env,
        scheduling_strategy / placement_group, max_retries, retry_exceptions)."""
        return RemoteFunction(self._function, parse_options(options, actor=False, base=self._options))

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Run the function in a task worker; a PendingRef (``get`` gives its value), retried
        under ``max_retries`` / ``retry_exceptions`` (see the module docstring)."""
        opts = self._options
        n = opts.num_returns
        if n is None:  # Ray's default: a generator function streams its items, else one ref
            fn = self._function
            n = Streaming() if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn) else 1
        if type(n) is Streaming:
            return self._stream(Streaming(opts.backpressure) if opts.backpressure is not None else n, args, kwargs)
        if not opts.max_retries and not opts.retry_exceptions:
            ref = self._send(args, kwargs)
        else:
            from podium.controller.remote.actorcalls import call_with_retries

            async def on_death(_err: BaseException, _token: Any, _can_retry: bool) -> str:
                return "retry"  # its pool dropped the dead worker: the next attempt gets another

            ref = call_with_retries(self.__name__, lambda: (self._send(args, kwargs), None), opts.max_retries,
                                    opts.retry_exceptions, on_death)
        return ref if n == 1 else split_returns(ref, n)

    def _stream(self, streaming: Streaming, args: tuple, kwargs: dict) -> Any:
        """A ``num_returns="streaming"`` call: its ObjectRefGenerator (controller.remote.streams),
        read from the pool worker that runs it. Not retried (Ray's default max_retries of 3 does
        not apply; another count is refused)."""
        opts = self._options
        if opts.max_retries not in (0, DEFAULT_TASK_RETRIES) or opts.retry_exceptions:
            raise UnimplementedError(f"{self.__name__}: a num_returns='streaming' task is not retried by Podium "
                                     f"(max_retries={opts.max_retries}, retry_exceptions={opts.retry_exceptions!r}): "
                                     "leave both unset and start the stream again yourself when it fails")
        pool = _pool_for(captured(opts, os.environ))
        handle = pool.pick()
        try:
            gen = stream_call(handle._group._calls, "run", (self._function, *args), kwargs, streaming)
        except BaseException as exc:
            pool.done(handle, exc)
            raise
        gen.completed().add_done_callback(lambda done: pool.done(handle, done.error()))
        return gen

    def _send(self, args: tuple, kwargs: dict) -> Any:
        """One attempt: the task sent to a worker of its pool."""
        pool = _pool_for(captured(self._options, os.environ))
        handle = pool.pick()
        method = "run_async" if inspect.iscoroutinefunction(self._function) else "run"
        try:
            ref = handle._group._calls.run([0], method, [((self._function, *args), kwargs)],
                                           blocking=False)[0]
        except BaseException as exc:
            pool.done(handle, exc)
            raise
        ref.add_done_callback(lambda done: pool.done(handle, done.error()))
        return ref

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ArgumentMismatchError(f"remote functions cannot be called directly: use '{self.__name__}.remote(...)'")


def remote(*args: Any, **options: Any) -> Any:
    """Ray's ``@ray.remote``: ``remote(fn)`` / ``remote(Cls)``, or ``remote(**options)`` as a
    decorator with options (``@podium.remote(num_cpus=2)``)."""
    if len(args) == 1 and not options and (inspect.isfunction(args[0]) or inspect.isclass(args[0])
                                          or callable(args[0])):
        target = args[0]
        if inspect.isclass(target):
            return ActorClass(target)
        return RemoteFunction(target)
    if args:
        raise InvalidArgumentError("remote() takes one function or class, or only keyword options")

    def decorate(target: Any) -> Any:
        if inspect.isclass(target):
            return ActorClass(target, parse_options(options, actor=True))
        if callable(target):
            return RemoteFunction(target, parse_options(options, actor=False))
        raise InvalidArgumentError(f"remote() decorates a function or a class, got {type(target).__name__}")

    return decorate
