"""``num_returns="streaming"`` (Ray's streaming generators): one call, its items as refs, each
one as the remote generator yields it.

``f.options(num_returns="streaming").remote()``, ``actor.m.options(num_returns="streaming")``,
``@ray.method(num_returns="streaming")``, and (as in Ray) any generator or async generator
function or method called without ``num_returns``, return an :class:`ObjectRefGenerator`.
``for ref in gen`` / ``next(gen)`` / ``async for ref in gen`` / ``await gen.__anext__()`` give
one ref per yielded item, as soon as it is yielded: a normal ref (``get``, ``await ref``, an
argument of another call). When the generator raises after k items, items 0..k-1 are fine, the
next ref raises the error, and the iteration ends; when its worker dies, the next ref raises
``WorkerDiedError`` (Ray's ``ActorDiedError``) with the reason.

How (the worker's side is :mod:`podium.worker.host.itemstreams`): the call is sent as the
hidden method ``__podium_stream__:<name>`` with a stream id chosen here; the worker runs the
generator as that call, in the method's usual place (the execution thread, its concurrency
group, or the loop) and holds each item as it is yielded. This side keeps one
``__podium_stream_next__`` call in flight, which the worker answers with the next item's ref
(or the error, or the end) outside the actor's concurrency slots, so an actor with
``max_concurrency=1`` busy in its generator still answers it. The worker buffers at most
``_generator_backpressure_num_objects`` items not yet taken (default
:data:`~podium.worker.host.itemstreams.DEFAULT_BUFFER`; Ray's default is no bound): a generator
that far ahead waits at its ``yield``. A generator dropped here (garbage) is closed at the
worker: the items not taken are released and the remote generator sees ``GeneratorExit`` at its
next ``yield``. ``completed()`` is the call's own ref (its value is the number of items; it
raises when the call failed outright); ``is_finished()`` and ``next_ready()`` answer as Ray's.

Where it differs from Ray: a streaming call is not retried (a task's ``max_retries``, an actor's
``max_task_retries``): the error of a dead worker is the next item's; the generator object
cannot be pickled into another call (as in Ray).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
from typing import Any

from podium.controller.session.futures import PendingRef
from podium.controller.session.gets import wait
from podium.errors import ArgumentMismatchError, UnimplementedError
from podium.worker.caller.streaming import (BACKPRESSURE_ATTR, STREAM_CALL, STREAM_CLOSE_CALL, STREAM_NEXT_CALL,
                                            STREAMING_RETURNS, check_buffer, declared_returns, is_end_of_stream)

__all__ = ["ObjectRefGenerator", "Streaming", "STREAMING", "BACKPRESSURE_ATTR", "check_buffer", "stream_call",
           "method_returns", "returns_from"]



@dataclasses.dataclass(frozen=True)
class Streaming:
    """``num_returns="streaming"`` as a checked option: with the worker's buffer bound
    (``_generator_backpressure_num_objects``; None: the default)."""

    backpressure: int | None = None

    def __post_init__(self) -> None:
        if self.backpressure is not None:
            check_buffer(self.backpressure)


#: ``num_returns="streaming"`` with the default buffer.
STREAMING = Streaming()


def returns_from(declared: dict[str, tuple[int, int | None]]) -> dict[str, Any]:
    """What an ActorHandle keeps of :func:`~podium.worker.caller.streaming.declared_returns`:
    name -> N, or a :class:`Streaming` with its bound."""
    return {name: Streaming(bound) if n == STREAMING_RETURNS else n for name, (n, bound) in declared.items()}


def method_returns(cls: type) -> dict[str, Any]:
    """``num_returns`` of the methods of ``cls`` that return other than one ref: ``ray.method``'s,
    and (as in Ray) a Streaming for every generator or async generator method without one."""
    return returns_from(declared_returns(cls))


def stream_call(calls: Any, method: str, args: tuple, kwargs: dict, streaming: Streaming,
                group: str | None = None, keep: Any = None) -> "ObjectRefGenerator":
    """Start a streaming call of ``method`` through ``calls`` (a one-worker group's
    ``GroupCaller``); ``group``: the actor's concurrency group it runs in (None: its own)."""
    from podium.controller.session.runtime import get_runtime

    return ObjectRefGenerator(calls, method, args, kwargs, streaming.backpressure, group, keep, get_runtime().loop)


class ObjectRefGenerator:
    """Ray's ``ObjectRefGenerator``: the refs of a streaming call's items (see the module).
    ``calls`` sends to the worker; ``loop``, the runtime's, sends the close of a dropped one."""

    def __init__(self, calls: Any, method: str, args: tuple, kwargs: dict, backpressure: int | None,
                 group: str | None, keep: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._calls = calls
        self._loop = loop
        self._keep = keep  # an actor's handle: the actor lives while its stream is read
        self._id = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._ended = False
        self._main: PendingRef = calls.run([0], STREAM_CALL + method,
                                           [((self._id, backpressure, group, *args), kwargs)], blocking=False)[0]
        self._main.keep = keep
        self._next: PendingRef = self._ask()  # the first item is asked for at once

    def _ask(self) -> PendingRef:
        ref = self._calls.run([0], STREAM_NEXT_CALL, [((self._id,), {})], blocking=False)[0]
        ref.keep = self._keep
        return ref

    def _outcome(self, asked: PendingRef) -> PendingRef | None:
        """What the settled ``asked`` (or the failed call) gives the caller: a ref (an item's,
        or one that raises the error), or None at the end. Called once per ask."""
        with self._lock:
            if self._ended:
                return None
            if self._next is not asked:  # another consumer took this one meanwhile
                return self._UNSETTLED
            main = self._main
            if not asked.done():  # the call itself failed (its worker died, it never ran)
                self._ended = True
                _close_soon(self._loop, self._calls, self._id, True)
                return main
            error = asked.error()
            if error is None:
                self._next = self._ask()
                return asked
            self._ended = True
            return None if is_end_of_stream(error) else asked

    #: ``_outcome``'s answer when another consumer advanced the stream first: ask again.
    _UNSETTLED: Any = object()

    def _failed(self) -> bool:
        main = self._main
        return main.done() and main.error() is not None

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> "ObjectRefGenerator":
        return self

    def __next__(self) -> PendingRef:
        """The next item's ref once it is yielded; StopIteration after the last (Ray's)."""
        while True:
            if self._ended:
                raise StopIteration
            asked = self._next
            while not asked.done() and not self._failed():
                # (A call that finished well leaves its items to come: then only they count.)
                wait([asked] if self._main.done() else [asked, self._main], num_returns=1)
            ref = self._outcome(asked)
            if ref is self._UNSETTLED:
                continue
            if ref is None:
                raise StopIteration
            return ref

    def __aiter__(self) -> "ObjectRefGenerator":
        return self

    async def __anext__(self) -> PendingRef:
        """``__next__`` awaited on the running loop, which stays free meanwhile."""
        while True:
            if self._ended:
                raise StopAsyncIteration
            asked = self._next
            if not asked.done() and not self._failed():
                waits = [asyncio.ensure_future(_settled(asked))]
                if not self._main.done():  # (a call that finished well leaves its items to come)
                    waits.append(asyncio.ensure_future(_settled(self._main)))
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiting in waits:
                        waiting.cancel()
                if not asked.done() and not self._failed():
                    continue
            ref = self._outcome(asked)
            if ref is self._UNSETTLED:
                continue
            if ref is None:
                raise StopAsyncIteration
            return ref

    # ---------------------------------------------------------------- Ray's other methods

    def completed(self) -> PendingRef:
        """The streaming call's own ref: ready when the generator finished (its value: the
        number of items); it raises when the call failed outright (e.g. its worker died)."""
        return self._main

    def is_finished(self) -> bool:
        """True once every item was taken and ``next`` would end the iteration."""
        if self._ended:
            return True
        asked = self._next
        return asked.done() and is_end_of_stream(asked.error())

    def next_ready(self) -> bool:
        """True when ``next(gen)`` would return a ref at once (False at the end)."""
        if self._ended:
            return False
        asked = self._next
        return (asked.done() and not is_end_of_stream(asked.error())) or self._failed()

    def send(self, value: Any) -> Any:
        """Not supported (as in Ray)."""
        raise UnimplementedError("`gen.send` is not supported.")

    def throw(self, *args: Any) -> Any:
        """Not supported (as in Ray)."""
        raise UnimplementedError("`gen.throw` is not supported.")

    def close(self) -> None:
        """Not supported (as in Ray): drop the generator to close it at the worker."""
        raise UnimplementedError("`gen.close` is not supported: drop the generator (del gen) to close it")

    async def asend(self, value: Any) -> Any:
        """Not supported (as in Ray)."""
        raise UnimplementedError("`gen.asend` is not supported.")

    async def athrow(self, *args: Any) -> Any:
        """Not supported (as in Ray)."""
        raise UnimplementedError("`gen.athrow` is not supported.")

    async def aclose(self) -> None:
        """Not supported (as in Ray): drop the generator to close it at the worker."""
        raise UnimplementedError("`gen.aclose` is not supported: drop the generator (del gen) to close it")

    def __reduce__(self) -> Any:
        raise ArgumentMismatchError("You cannot return or pass a generator to other task. Serializing a "
                                    "ObjectRefGenerator is not allowed.")

    def __del__(self) -> None:
        # Dropped before its end: the worker closes the stream (its items not taken go).
        try:
            if not self._ended:
                self._ended = True
                _close_soon(self._loop, self._calls, self._id, self._main.done())
        except Exception:  # noqa: BLE001 - never raise from a finalizer (e.g. at exit)
            pass

    def __repr__(self) -> str:
        return f"ObjectRefGenerator({self._main.method}, {'finished' if self._ended else 'streaming'})"


async def _settled(ref: PendingRef) -> None:
    try:
        await ref.aref()
    except BaseException:  # noqa: BLE001 - only waiting; the caller reads the outcome
        pass


def _close_soon(loop: asyncio.AbstractEventLoop, calls: Any, stream_id: str, final: bool) -> None:
    """Tell the worker that the stream ``stream_id`` was dropped, from the runtime's ``loop`` (a
    finalizer may run on any thread, at any allocation: it only queues)."""
    def send() -> None:
        try:
            calls.run([0], STREAM_CLOSE_CALL, [((stream_id, final), {})], blocking=False)
        except Exception:  # noqa: BLE001 - a worker or runtime already gone has nothing to close
            pass

    try:
        loop.call_soon_threadsafe(send)
    except RuntimeError:  # the loop is closed (the runtime shut down): nothing is left to close
        pass
