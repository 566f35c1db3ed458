"""Streaming calls (Ray's ``num_returns="streaming"``) in a worker: the items a generator
yields, held here one by one and handed to the caller as it asks for them.

A streaming call is an ordinary call of a hidden method name, :data:`STREAM_CALL` followed by
the user's method (``"__podium_stream__:generate"``), so it enters and leaves the host as any
call does (admission, order, the execution thread or the loop, ``CallCompletion``). Its
arguments start with the stream's id (chosen by the caller, 64 random bits: a capability, as a
held value's id) and the bound of its buffer. The runner it names (:meth:`StreamCalls.lookup`)
calls the method, iterates what it returned where the method runs (a sync generator on the
execution thread, or in its concurrency group's threads; an async generator on the loop, in its
group's slots) and holds each item in the host's store (``HeldStore``, under the hold budget)
as it is yielded. The call's own reply comes when the generator ends: the number of items.

The caller takes the items with :data:`STREAM_NEXT_CALL` calls, which run on the loop beside
whatever runs (so a ``max_concurrency=1`` actor busy in its generator still answers them): each
answers with the next item's ref (the held value, inline when small) as soon as one is there,
the generator's error once (Ray's rule: the items before it are fine, the next ref raises it),
then the end (``OutOfRangeError`` with ``details["stream"] == "end"``). :data:`STREAM_CLOSE_CALL`
closes a stream the caller dropped: the items not taken are released and the generator is
closed at its next ``yield`` (``GeneratorExit`` in it), so no item and no thread is left behind.

The names, bounds and the end-of-stream answer are shared with the caller's side in
:mod:`podium.worker.caller.streaming`. Bounds: at most :data:`MAX_STREAMS` streams per worker;
each buffers at most its bound of items produced and not yet taken
(``_generator_backpressure_num_objects``, else ``DEFAULT_BUFFER``, 1024; at most
``MAX_BUFFER``, 65,536): a generator that is that far ahead waits at
its ``yield`` until the caller takes one. When the caller's connection ends, the streams it read
are closed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import inspect
import threading
from typing import Any, Callable

from podium import errors
from podium.worker.caller.streaming import (DEFAULT_BUFFER, STREAM_CALL, STREAM_CLOSE_CALL, STREAM_NEXT_CALL,
                                            check_buffer, end_of_stream)
from podium.worker.host.results import Outcome, remote_error

__all__ = ["MAX_STREAMS", "ItemStream", "StreamCalls", "current_connection"]

#: The most streams one worker keeps at once.
MAX_STREAMS = 10_000
#: Longest stream id accepted.
_MAX_ID = 64

#: The call connection (a CallStream) whose call runs now on the loop: set once per connection
#: by ``CallStream.run``; the streams record who reads them, to close them when it goes.
current_connection: contextvars.ContextVar[Any] = contextvars.ContextVar("podium_stream_reader", default=None)


def _set(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _wake(future: asyncio.Future) -> None:
    """Complete ``future`` on its own loop, from any thread (a producer may run on an async
    actor's group loop, the caller's next on the host's)."""
    future.get_loop().call_soon_threadsafe(_set, future)


class ItemStream:
    """One streaming call's items: held refs not yet taken, at most ``bound`` of them, then
    its end (or error). The producer runs on a thread or on the loop; ``take`` on the loop."""

    def __init__(self, stream_id: str, loop: asyncio.AbstractEventLoop, bound: int = DEFAULT_BUFFER) -> None:
        self.stream_id = stream_id
        self.loop = loop
        self.bound = bound
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # a producer thread waits here when full
        self._items: collections.deque = collections.deque()  # ObjectRefInfo of held items
        self._async_room: asyncio.Future | None = None  # an async producer waiting (loop)
        self._taker: asyncio.Future | None = None  # a next waiting for an item (loop)
        self.error: BaseException | None = None  # the generator's, delivered once
        self.started = False
        self.ended = False  # the producer finished
        self.closed = False  # the caller dropped it
        self.delivered = False  # the end (or error) was handed to the caller
        self.reader: Any = None  # the connection that takes its items
        self.produced = 0

    # ---------------------------------------------------------------- the producer's side

    def put(self, info: Any) -> bool:
        """Add an item (from a producer thread), waiting while the buffer is full; False when
        the stream was closed (the item is not kept)."""
        with self._lock:
            while len(self._items) >= self.bound and not self.closed:
                self._room.wait()
            if self.closed:
                return False
            self._items.append(info)
            self.produced += 1
            taker, self._taker = self._taker, None
        if taker is not None:
            _wake(taker)
        return True

    async def aput(self, info: Any) -> bool:
        """Add an item (an async producer, on the host's loop or its group's), as :meth:`put`."""
        while True:
            with self._lock:
                if self.closed:
                    return False
                if len(self._items) < self.bound:
                    self._items.append(info)
                    self.produced += 1
                    taker, self._taker = self._taker, None
                    break
                room = self._async_room = asyncio.get_running_loop().create_future()
            await room
        if taker is not None:
            _wake(taker)
        return True

    def finish(self, error: BaseException | None) -> None:
        """The producer ended (``error``: what the generator raised, as the caller sees it)."""
        with self._lock:
            self.ended = True
            self.error = error
            taker, self._taker = self._taker, None
        if taker is not None:
            _wake(taker)

    # ---------------------------------------------------------------- the caller's side

    async def take(self) -> Any:
        """The next item's ref (ObjectRefInfo), waiting for one; raises the generator's error
        once, then the end of stream (also once the stream was closed)."""
        while True:
            with self._lock:
                if self._items:
                    info = self._items.popleft()
                    self._room.notify()
                    room, self._async_room = self._async_room, None
                    break
                if self.ended or self.closed:
                    self.delivered = True
                    error, self.error = self.error, None
                    raise error if error is not None else end_of_stream(self.stream_id)
                if self._taker is not None:
                    raise errors.FailedPreconditionError(f"stream {self.stream_id}: a next is already waiting")
                taker = self._taker = self.loop.create_future()
            try:
                await taker
            finally:
                with self._lock:
                    if self._taker is taker:
                        self._taker = None
        if room is not None:
            _wake(room)
        return info

    def close(self) -> list[str]:
        """Close it (the caller dropped it): the ids of the held items not taken, to release;
        the producer stops at its next item, a waiting next gets the end."""
        with self._lock:
            self.closed = True
            ids = [info.object_id for info in self._items]
            self._items.clear()
            self._room.notify_all()
            room, self._async_room = self._async_room, None
            taker, self._taker = self._taker, None
        for future in (room, taker):
            if future is not None:
                _wake(future)
        return ids


class StreamCalls:
    """A host's streams and the three hidden methods that run them (see the module).

    ``hold(value) -> ObjectRefInfo`` holds an item in the host's store; ``release(ids)`` drops
    held items; ``rank`` and ``node`` name this worker in the errors of its generators;
    ``reads_on_loop()`` is entered on the execution thread while a generator runs there, so that
    the loop keeps reading the sockets its caller's next calls come on
    (``ExecutionThread.reads_on_loop``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, hold: Callable[[Any], Any], release: Callable[[list], Any],
                 rank: int, node: str, reads_on_loop: Callable[[], Any] = contextlib.nullcontext) -> None:
        self._loop = loop
        self._reads_on_loop = reads_on_loop
        self._hold = hold
        self._release = release
        self._rank = rank
        self._node = node
        self._streams: dict[str, ItemStream] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._streams)

    def _stream(self, stream_id: Any, make: bool = True) -> ItemStream | None:
        if not isinstance(stream_id, str) or not stream_id or len(stream_id) > _MAX_ID:
            raise errors.InvalidArgumentError(f"a stream id is a string of 1 to {_MAX_ID} characters, "
                                              f"got {stream_id!r}")
        with self._lock:
            stream = self._streams.get(stream_id)
            if stream is None and make:
                if len(self._streams) >= MAX_STREAMS:
                    raise errors.ResourceExhaustedError(f"this worker has {len(self._streams)} streams open "
                                                        f"already (the most: {MAX_STREAMS})")
                stream = self._streams[stream_id] = ItemStream(stream_id, self._loop)
            return stream

    def _drop(self, stream: ItemStream) -> None:
        with self._lock:
            if self._streams.get(stream.stream_id) is stream:
                del self._streams[stream.stream_id]

    # ---------------------------------------------------------------- lookup

    def lookup(self, name: str, find: Callable[[str], tuple[Any, bool, bool]], hosted: Any
               ) -> tuple[Any, bool, bool]:
        """``(runner, is_async, materialize)`` for a hidden stream method name (``find``: the
        host's lookup of the user's methods, ``hosted``: its object)."""
        if name == STREAM_NEXT_CALL:
            return self.next, True, False
        if name == STREAM_CLOSE_CALL:
            return self.close, True, False
        target = name[len(STREAM_CALL):]
        if not name.startswith(STREAM_CALL) or not target or target.startswith("__"):
            raise errors.UnknownMethodError(f"no streaming method {target!r}", details={"method": name})
        shell_stream = getattr(type(hosted), "_podium_stream", None)
        if shell_stream is not None:  # an ActorShell: the generator runs in its method's group
            async def in_group(stream_id: str, bound: Any, group: str | None, /, *args: Any, **kwargs: Any) -> int:
                stream = self._start(stream_id, bound)
                if stream is None:
                    return 0
                return await self._produced(stream, hosted._podium_stream(
                    target, group, lambda fn: self._drive(stream, fn, args, kwargs),
                    lambda fn: self._call_async(stream, fn, args, kwargs)))
            return in_group, True, find(target)[2]
        fn, is_async, materialize = find(target)
        if is_async or inspect.isasyncgenfunction(fn):
            async def on_loop(stream_id: str, bound: Any, group: str | None, /, *args: Any, **kwargs: Any) -> int:
                self._no_group(group)
                stream = self._start(stream_id, bound)
                if stream is None:
                    return 0
                return await self._produced(stream, self._call_async(stream, fn, args, kwargs))
            return on_loop, True, materialize

        def on_thread(stream_id: str, bound: Any, group: str | None, /, *args: Any, **kwargs: Any) -> int:
            self._no_group(group)
            stream = self._start(stream_id, bound)
            if stream is None:
                return 0
            try:
                with self._reads_on_loop():
                    return self._drive(stream, fn, args, kwargs)
            finally:
                self._ended(stream)
        return on_thread, False, materialize

    @staticmethod
    def _no_group(group: Any) -> None:
        if group is not None:
            raise errors.UnknownMethodError("this actor declares no concurrency_groups: a call cannot name a "
                                            "concurrency group of it", details={"method": STREAM_CALL})

    def _start(self, stream_id: str, bound: Any) -> ItemStream | None:
        """The stream a streaming call produces into (None: the caller closed it already)."""
        stream = self._stream(stream_id)
        assert stream is not None
        if stream.started:
            raise errors.InvalidArgumentError(f"stream {stream_id} was started already")
        stream.bound = check_buffer(bound)
        stream.started = True
        if stream.closed:
            self._drop(stream)
            return None
        if stream.reader is None:
            stream.reader = current_connection.get()
        return stream

    def _ended(self, stream: ItemStream) -> None:
        if stream.closed or stream.delivered:
            self._drop(stream)

    async def _produced(self, stream: ItemStream, running: Any) -> int:
        try:
            return await running
        finally:
            self._ended(stream)

    # ---------------------------------------------------------------- producing

    def _error(self, exc: BaseException) -> BaseException:
        if isinstance(exc, errors.PodiumError):
            return exc
        return remote_error(exc, self._rank, self._node)

    def _not_a_generator(self, value: Any) -> BaseException:
        return errors.InvalidArgumentError(f"a num_returns='streaming' call must return a generator or an async "
                                           f"generator, got {type(value).__name__}")

    def _drive(self, stream: ItemStream, value: Any, args: tuple | None = None, kwargs: dict | None = None) -> int:
        """Iterate a sync generator here (``value``, or ``value(*args, **kwargs)``), holding each
        item; an async generator is iterated on the loop while this thread waits. The number of
        items; the generator's error goes to the stream, not to this call."""
        try:
            if args is not None:
                value = value(*args, **(kwargs or {}))
            if inspect.isasyncgen(value):
                return asyncio.run_coroutine_threadsafe(self._adrive(stream, value), self._loop).result()
            if not inspect.isgenerator(value):
                raise self._not_a_generator(value)
        except BaseException as exc:  # noqa: BLE001 - the caller's next ref raises it
            stream.finish(self._error(exc))
            return 0
        error = None
        try:
            for item in value:
                info = self._hold(item)
                if not stream.put(info):
                    self._release([info.object_id])
                    break
        except BaseException as exc:  # noqa: BLE001 - the generator's (or holding's) error
            error = self._error(exc)
        finally:
            value.close()  # a closed stream's generator sees GeneratorExit at its yield
            stream.finish(error)
        return stream.produced

    async def _call_async(self, stream: ItemStream, fn: Any, args: tuple, kwargs: dict) -> int:
        try:
            value = fn(*args, **kwargs)
            if inspect.iscoroutine(value):
                value = await value
        except BaseException as exc:  # noqa: BLE001 - the caller's next ref raises it
            stream.finish(self._error(exc))
            return 0
        if inspect.isgenerator(value):  # a sync generator from an async method: off the loop
            return await asyncio.to_thread(self._drive, stream, value)
        return await self._adrive(stream, value)

    async def _adrive(self, stream: ItemStream, value: Any) -> int:
        """Iterate an async generator on the loop, as :meth:`_drive`."""
        if not inspect.isasyncgen(value):
            stream.finish(self._error(self._not_a_generator(value)))
            return 0
        error: BaseException | None = None
        try:
            async for item in value:
                info = self._hold(item)
                if not await stream.aput(info):
                    self._release([info.object_id])
                    break
        except asyncio.CancelledError:
            error = errors.CancelledError(f"stream {stream.stream_id}: its caller's connection ended")
            raise
        except BaseException as exc:  # noqa: BLE001 - the generator's (or holding's) error
            error = self._error(exc)
        finally:
            try:
                await value.aclose()
            finally:
                stream.finish(error)
        return stream.produced

    # ---------------------------------------------------------------- the hidden calls

    async def next(self, stream_id: str) -> Outcome:
        """``STREAM_NEXT_CALL``: the next item's ref, as a held result's reply."""
        stream = self._stream(stream_id)
        assert stream is not None
        if stream.reader is None:
            stream.reader = current_connection.get()
        try:
            info = await stream.take()
        except BaseException:
            if stream.ended or (stream.closed and not stream.started):
                self._drop(stream)
            raise
        return Outcome(ref=info)

    async def close(self, stream_id: str, final: bool = False) -> None:
        """``STREAM_CLOSE_CALL``: the caller dropped the stream (see the module)."""
        stream = self._stream(stream_id, make=not final)
        if stream is None:
            return
        ids = stream.close()
        if ids:
            self._release(ids)
        if stream.ended or final:
            self._drop(stream)

    def connection_ended(self, reader: Any) -> None:
        """The connection ``reader`` ended: close the streams it read (their producers stop)."""
        with self._lock:
            mine = [s for s in self._streams.values() if s.reader is reader]
        for stream in mine:
            ids = stream.close()
            if ids:
                self._release(ids)
            if stream.ended:
                self._drop(stream)
