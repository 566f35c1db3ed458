"""Results of ``blocking=False`` calls: handles that exist before the result does.

A non-blocking WorkerGroup call returns at once. Each rank's result stays in its worker
(the call is made with ``hold_result``), and the caller gets:

* a :class:`PendingRef` per rank for list-collect modes (Ray's ``ObjectRef`` role): it
  becomes a :class:`podium.refs.ObjectRef` once the call finished;
* a :class:`PendingDataProtoFuture` for concat modes (``DP_COMPUTE_PROTO`` and friends):
  a :class:`podium.refs.DataProtoFuture` whose refs are filled in when the producers
  finish. ``chunk(n)``/``slice`` on it stay lazy, so handing it to another group's call
  does not block the controller; padding is removed through its row range (verl returns
  the future padded).

Pass either to another WorkerGroup call and the consuming workers fetch the rows they need
straight from the producing workers (worker to worker); :mod:`~podium.controller.session.gets`
fetches values into the controller and waits for some of them like ``ray.wait``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable, Iterable

from podium.errors import ArgumentMismatchError, DeadlineExceededError, InternalError
from podium.refs import DataProtoFuture, ObjectRef, keep_if_exported

__all__ = ["PendingRef", "PendingDataProtoFuture", "concat_refs", "wait_all",
           "first_failed", "is_pending", "unpadded_future"]

log = logging.getLogger("podium.controller")


#: Where threads wait for PendingRefs: one condition for every ref in the process. A
#: waiter marks the ref it blocks on (``_watched``); settling a marked ref notifies, so a
#: burst of results costs a handful of wake-ups, not one per ref (see PendingRef._settle).
_board = threading.Condition(threading.Lock())

_PENDING, _VALUE, _ERROR = 0, 1, 2

#: Failed calls so far, counted under ``_board``. Every failure notifies the board, so a
#: waiter on many refs learns of one (and fails fast, as ``ray.get`` does) without
#: watching each ref; successes only notify a waiter that watches that very ref.
_failures = 0


class PendingRef:
    """One rank's held result of a ``blocking=False`` call (becomes an ObjectRef).

    It is its own future, settled once by the runtime's loop thread when the worker
    answers, and the only object a non-blocking call keeps per rank (a cheap handle for a
    burst of thousands of calls). ``release(object_id)`` runs when the ref is garbage
    after its call succeeded: the result held in the worker is dropped then.
    """

    __slots__ = ("rank", "method", "_state", "_outcome", "_watched", "_callbacks", "_release",
                 "keep", "__weakref__")

    def __init__(self, rank: int, method: str, release: Callable[[str], None] | None = None) -> None:
        self.rank = rank
        self.method = method
        self._state = _PENDING
        self._outcome: Any = None
        self._watched = False
        self._callbacks: list | None = None
        self._release = release
        #: What must live while this ref does (an actor call's handle: as in Ray, an actor
        #: whose caller dropped its handle still answers the calls made through it).
        self.keep: Any = None

    def done(self) -> bool:
        """True once the call finished (successfully or not)."""
        return self._state != _PENDING

    def error(self) -> BaseException | None:
        """The call's error once it failed; None while pending or when it succeeded."""
        return self._outcome if self._state == _ERROR else None

    def ref(self, timeout: float | None = None) -> ObjectRef:
        """The ObjectRef, waiting up to ``timeout`` seconds (None: no limit) for the call.

        Raises the call's error (RemoteError, WorkerDiedError, ...).
        """
        if self._state == _PENDING and not wait_all([self], timeout):
            raise DeadlineExceededError(
                f"{self.method} on rank {self.rank} did not finish within {timeout}s")
        return self._result()

    def _result(self) -> ObjectRef:
        """The outcome of a finished call: its ObjectRef, or its error raised."""
        if self._state == _ERROR:
            raise self._outcome
        return self._outcome

    async def aref(self) -> ObjectRef:
        """The ObjectRef, awaited on the running loop."""
        if self._state == _PENDING:
            loop = asyncio.get_running_loop()
            woken = loop.create_future()
            loop_thread = threading.get_ident()

            def settle() -> None:
                if not woken.done():
                    woken.set_result(None)

            def wake(_ref: "PendingRef") -> None:
                if threading.get_ident() == loop_thread:
                    settle()
                else:  # settled on another thread (tests do): hand over to the loop
                    loop.call_soon_threadsafe(settle)

            self.add_done_callback(wake)
            await woken
        return self._result()

    def add_done_callback(self, fn: Callable[["PendingRef"], None]) -> None:
        """Call ``fn(ref)`` once the call finished (at once if it has), on the settling thread."""
        if self._state != _PENDING:
            fn(self)
            return
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(fn)

    def get(self, timeout: float | None = None) -> Any:
        """The value: waits for the call, then fetches the result from its worker (``timeout``:
        the call timeout, none by default)."""
        return _get_one(self, timeout)

    def __await__(self):
        """``await ref``: the value, on any event loop (the driver's own, an async actor's),
        which stays free meanwhile; a failed call raises its error, as ``get`` does."""
        return _await_value(self).__await__()

    def future(self) -> concurrent.futures.Future:
        """The value as a ``concurrent.futures.Future`` (Ray's ``ref.future()``;
        ``asyncio.wrap_future`` makes it awaitable on any loop)."""
        from podium.controller.session.runtime import get_runtime
        return asyncio.run_coroutine_threadsafe(_aget_value(self), get_runtime().loop)

    def __reduce__(self):
        # Pickled into another call's arguments or a result, the ref travels as the
        # ObjectRef it becomes: a ref still computing is waited for here first (a group
        # call waits without blocking its caller: GroupCaller resolves nested refs before
        # encoding), and a failed call's error is raised here, to the sender.
        value = self.ref()
        keep_if_exported(self)  # inside a worker's result: its held value outlives this ref
        return value.__reduce__()

    def set_result(self, ref: ObjectRef) -> bool:
        """Settle with the call's ObjectRef (from any thread); False if already settled."""
        return self._settle(_VALUE, ref)

    def set_exception(self, exc: BaseException) -> bool:
        """Settle with the call's error (from any thread); False if already settled."""
        return self._settle(_ERROR, exc)

    def _settle(self, state: int, outcome: Any) -> bool:
        if self._state != _PENDING:
            return False
        self._outcome = outcome
        self._state = state
        # A waiter sets _watched before it reads _state, under _board, and holds _board
        # until it sleeps: so either it sees the state set above, or this sees its mark
        # and the notify below reaches it asleep.
        if state == _ERROR:
            global _failures
            with _board:
                _failures += 1
                _board.notify_all()
        elif self._watched:
            with _board:
                _board.notify_all()
        callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - one waiter's failure must not stop the others
                log.exception("PendingRef callback %r failed", fn)
        return True

    def __del__(self) -> None:
        # The result stays in its worker only while something here can name it.
        if self._state == _VALUE and self._release is not None:
            try:
                self._release(self._outcome.object_id)
            except Exception:  # noqa: BLE001 - never raise from a finalizer (e.g. at exit)
                pass

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"PendingRef({self.method} rank {self.rank}, {state})"


def first_failed(refs: Iterable[Any]) -> PendingRef | None:
    """The first PendingRef of ``refs`` (in order) whose call failed, or None."""
    return next((r for r in refs if type(r) is PendingRef and r._state == _ERROR), None)


def wait_all(refs: list[PendingRef], timeout: float | None) -> bool:
    """Wait until every PendingRef in ``refs`` finished or one of them failed, at most
    ``timeout`` seconds (None: no limit); True if so. Refs that finish in order cost one pass.

    Failing fast is ``ray.get``'s rule for a list: a dead rank usually means the others
    never finish, and their refs stay valid to be fetched or waited on later.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    i, n = 0, len(refs)
    with _board:
        seen = -1
        while i < n:
            if seen != _failures:  # some call failed since the last look: one of ours?
                seen = _failures
                if first_failed(refs[i:]) is not None:
                    return True
            ref = refs[i]
            ref._watched = True  # before reading _state: see PendingRef._settle
            if ref._state != _PENDING:
                i += 1
                continue
            if deadline is None:
                _board.wait()
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                _board.wait(remaining)
    return True


class PendingDataProtoFuture(DataProtoFuture):
    """A DataProtoFuture over results that may still be computing.

    ``refs``/``start``/``stop`` (and everything built on them, e.g. ``len()``) wait for the
    producers; ``chunk``, ``slice`` and ``unpadded`` stay lazy.
    """

    __slots__ = ("_source", "_op", "_resolved", "_lock")

    def __init__(self, source: list[PendingRef | ObjectRef] | "PendingDataProtoFuture",
                 op: tuple | None = None) -> None:
        # DataProtoFuture.__init__ validates refs we do not have yet: not called on purpose.
        self._source = source
        self._op = op
        self._resolved: DataProtoFuture | None = None
        self._lock = threading.Lock()

    # ---- laziness ---------------------------------------------------------------------

    def _pending_refs(self) -> list[PendingRef]:
        node = self
        while isinstance(node._source, PendingDataProtoFuture):
            node = node._source
        return [r for r in node._source if isinstance(r, PendingRef)]

    def done(self) -> bool:
        """True once every producing call finished, or one failed (its get raises at once)."""
        refs = self._pending_refs()
        return all(r.done() for r in refs) or first_failed(refs) is not None

    def _apply(self, base: DataProtoFuture) -> DataProtoFuture:
        if self._op is None:
            return base
        kind = self._op[0]
        if kind == "chunk":
            _, i, n = self._op
            return base.chunk(n)[i]
        if kind == "slice":
            _, a, b = self._op
            return base.slice(a, b)
        if kind == "unpad":
            return base.slice(0, len(base) - self._op[1])
        raise InternalError(f"PendingDataProtoFuture has an unknown op {self._op!r} "
                            f"(a bug in podium.controller.session.futures)")

    def resolved(self, timeout: float | None = None) -> DataProtoFuture:
        """The plain DataProtoFuture, waiting up to ``timeout`` for the producers."""
        if self._resolved is None:
            if isinstance(self._source, PendingDataProtoFuture):
                base = self._source.resolved(timeout)
            else:
                pending = [r for r in self._source if isinstance(r, PendingRef)]
                if not wait_all(pending, timeout):  # returns early when a producer failed
                    raise DeadlineExceededError(
                        f"the producers of a DataProtoFuture did not finish within {timeout}s")
                failed = first_failed(pending)
                if failed is not None:
                    failed._result()  # raises its error
                refs = [r._result() if isinstance(r, PendingRef) else r for r in self._source]
                base = DataProtoFuture(refs)
            with self._lock:
                self._resolved = self._apply(base)
        return self._resolved

    async def aresolved(self) -> DataProtoFuture:
        """The plain DataProtoFuture, awaited on the runtime's loop."""
        if self._resolved is None:
            if isinstance(self._source, PendingDataProtoFuture):
                base = await self._source.aresolved()
            else:
                # gather raises the first producer's failure as soon as it happens.
                refs = list(await asyncio.gather(*(_resolve_one(r) for r in self._source)))
                base = DataProtoFuture(refs)
            self._resolved = self._apply(base)
        return self._resolved

    # ---- the DataProtoFuture surface --------------------------------------------------

    @property
    def refs(self):
        """The producers' refs (waits for them)."""
        return self.resolved().refs

    @property
    def start(self):
        """First row (waits for the producers)."""
        return self.resolved().start

    @property
    def stop(self):
        """End row (waits for the producers)."""
        return self.resolved().stop

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """``chunks`` lazy futures over equal row ranges (checked when resolved)."""
        if self._resolved is not None:
            return self._resolved.chunk(chunks)
        return [type(self)(self, ("chunk", i, chunks)) for i in range(chunks)]

    def slice(self, start: int, stop: int) -> DataProtoFuture:
        """Rows ``[start, stop)``, lazily."""
        if self._resolved is not None:
            return self._resolved.slice(start, stop)
        return type(self)(self, ("slice", start, stop))

    def unpadded(self, padding_size: int) -> DataProtoFuture:
        """The same future without its last ``padding_size`` rows, lazily."""
        if not padding_size:
            return self
        return type(self)(self, ("unpad", padding_size))

    def get(self, timeout: float | None = None) -> Any:
        """Wait for the producers, then fetch and concatenate the covered rows."""
        return _get_one(self, timeout)

    async def aget(self, timeout: float | None = None) -> Any:
        """Async :meth:`get` (on the runtime's loop)."""
        resolved = await self.aresolved()
        return await resolved.aget(timeout)

    def __reduce__(self):
        resolved = self.resolved()
        return (DataProtoFuture, (resolved.refs, resolved.start, resolved.stop))

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        if self._resolved is not None:
            return repr(self._resolved)
        return f"PendingDataProtoFuture({'done' if self.done() else 'pending'}, op={self._op})"


def unpadded_future(future: DataProtoFuture, padding_size: int) -> DataProtoFuture:
    """``future`` without its last ``padding_size`` rows (lazily when still pending)."""
    if isinstance(future, PendingDataProtoFuture):
        return future.unpadded(padding_size)
    return future.slice(0, len(future) - padding_size) if padding_size else future


def concat_refs(outputs: list) -> DataProtoFuture:
    """A DataProtoFuture over per-rank outputs (ObjectRefs, PendingRefs or futures)."""
    flat: list = []
    for value in outputs:
        if isinstance(value, PendingDataProtoFuture) or (
                isinstance(value, DataProtoFuture) and not isinstance(value, PendingDataProtoFuture)):
            raise ArgumentMismatchError("cannot concatenate DataProtoFutures; collect the per-rank refs instead "
                                        "(a collect function over ObjectRefs or PendingRefs)")
        flat.append(value)
    if all(isinstance(v, ObjectRef) for v in flat):
        return DataProtoFuture.concat(flat)
    return PendingDataProtoFuture(flat)


def is_pending(value: Any) -> bool:
    """True for a PendingRef or a PendingDataProtoFuture."""
    return isinstance(value, (PendingRef, PendingDataProtoFuture))


async def _resolve_one(value: Any) -> Any:
    if isinstance(value, PendingRef):
        return await value.aref()
    if isinstance(value, PendingDataProtoFuture):
        return await value.aresolved()
    return value


async def _aget_value(value: Any) -> Any:
    if isinstance(value, PendingRef):
        value = await value.aref()
    if isinstance(value, PendingDataProtoFuture):
        value = await value.aresolved()
    if isinstance(value, ObjectRef):
        from podium.refs import get_resolver
        return await get_resolver().fetch(value)
    if isinstance(value, DataProtoFuture):
        return await value.aget()
    return value


def _get_one(value: Any, timeout: float | None) -> Any:
    """The value of one pending result, fetched through the session's loop (``timeout``: the
    call timeout when None, which is none unless one was set)."""
    from podium.controller.session.calltimeout import effective_call_timeout
    from podium.controller.session.runtime import get_runtime
    rt = get_runtime()
    timeout = effective_call_timeout(rt.call_timeout) if timeout is None else timeout
    return rt.run(_aget_value(value), timeout=timeout, what="get")


async def _await_value(value: Any) -> Any:
    """The value of a ref or future, awaited on the running loop; fetched on the runtime's."""
    from podium.controller.session.runtime import get_runtime
    from podium.refs import on_loop
    return await on_loop(get_runtime().loop, _aget_value(value))
