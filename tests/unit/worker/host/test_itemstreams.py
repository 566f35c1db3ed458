"""A worker's streaming calls (podium.worker.host.itemstreams), driven without sockets: the
runner a streaming call looks up, the hidden next and close calls, the buffer's bound, the end,
the generator's error, a stream closed before or while it runs, and the table's bounds."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

from podium import errors
from podium.worker.caller.streaming import (DEFAULT_BUFFER, STREAM_CALL, STREAM_CLOSE_CALL, STREAM_NEXT_CALL,
                                            is_end_of_stream)
from podium.worker.host import itemstreams
from podium.worker.host.itemstreams import StreamCalls, current_connection
from podium.worker.host.results import Outcome


class Held:
    """A held item's description, as the host's store gives it."""

    def __init__(self, object_id: str) -> None:
        self.object_id = object_id


class FakeStore:
    """Holds items by id and records releases (the host's HeldStore, reduced)."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}
        self.released: list[str] = []
        self._ids = itertools.count()

    def hold(self, value: object) -> Held:
        object_id = f"o-{next(self._ids)}"
        self.values[object_id] = value
        return Held(object_id)

    def release(self, ids: list[str]) -> int:
        self.released.extend(ids)
        for object_id in ids:
            self.values.pop(object_id, None)
        return len(ids)


class Producer:
    """A hosted object with generator methods; ``resumed`` counts the yields resumed."""

    def __init__(self) -> None:
        self.resumed = 0
        self.closed = threading.Event()
        self.go_on = threading.Event()
        self.ran = False

    def count(self, n: int):
        for i in range(n):
            yield i
            self.resumed += 1

    def waits_after_first(self):
        yield "first"
        assert self.go_on.wait(30)
        yield "second"

    def endless(self):
        try:
            for i in itertools.count():
                yield i
                self.resumed += 1
        finally:
            self.closed.set()

    def fails_after(self, k: int):
        yield from range(k)
        raise ValueError(f"boom after {k}")

    def not_a_generator(self) -> int:
        self.ran = True
        return 5

    async def acount(self, n: int):
        for i in range(n):
            yield i
            await asyncio.sleep(0)


def find(obj):
    def lookup(name: str):
        fn = getattr(obj, name)
        return fn, asyncio.iscoroutinefunction(fn), True
    return lookup


async def started(obj: Producer, store: FakeStore, method: str, stream_id: str, *args, bound=None):
    """The streaming call of ``method`` running (a sync one on a thread of its own, as on the
    execution thread), and the StreamCalls it runs in."""
    calls = StreamCalls(asyncio.get_running_loop(), store.hold, store.release, 0, "127.0.0.1")
    runner, is_async, _ = calls.lookup(STREAM_CALL + method, find(obj), obj)
    if is_async:
        running = asyncio.ensure_future(runner(stream_id, bound, None, *args))
    else:
        running = asyncio.ensure_future(asyncio.to_thread(runner, stream_id, bound, None, *args))
    return calls, running


async def take(calls: StreamCalls, store: FakeStore, stream_id: str):
    outcome = await calls.next(stream_id)
    assert type(outcome) is Outcome
    return store.values[outcome.ref.object_id]


def test_items_come_in_order_then_the_end_and_the_stream_is_gone():
    async def main():
        store, obj = FakeStore(), Producer()
        calls, running = await started(obj, store, "count", "s1", 3)
        assert [await take(calls, store, "s1") for _ in range(3)] == [0, 1, 2]
        with pytest.raises(errors.OutOfRangeError) as ended:
            await calls.next("s1")
        assert is_end_of_stream(ended.value)
        assert await running == 3
        assert len(calls) == 0
    asyncio.run(main())


def test_an_item_is_handed_over_before_the_next_is_yielded():
    async def main():
        store, obj = FakeStore(), Producer()
        calls, running = await started(obj, store, "waits_after_first", "s2")
        assert await take(calls, store, "s2") == "first"  # while the generator waits for go_on
        assert not running.done()
        obj.go_on.set()
        assert await take(calls, store, "s2") == "second"
        assert await running == 2
    asyncio.run(main())


def test_the_buffer_bounds_how_far_the_generator_runs_ahead():
    async def main():
        store, obj = FakeStore(), Producer()
        calls, running = await started(obj, store, "endless", "s3", bound=2)
        while obj.resumed < 2:  # items 0 and 1 buffered; item 2 waits for room at its yield
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert obj.resumed == 2 and len(store.values) == 3
        assert await take(calls, store, "s3") == 0
        while obj.resumed < 3:
            await asyncio.sleep(0.01)
        await calls.close("s3")  # the caller drops it: the items not taken go, the generator closes
        assert await running >= 3
        assert obj.closed.is_set()
        assert store.values == {"o-0": 0}  # only the item handed over (its ref releases it)
        assert len(calls) == 0
    asyncio.run(main())


def test_the_generators_error_comes_after_its_items_then_the_end():
    async def main():
        store, obj = FakeStore(), Producer()
        calls, running = await started(obj, store, "fails_after", "s4", 2)
        assert [await take(calls, store, "s4") for _ in range(2)] == [0, 1]
        with pytest.raises(errors.RemoteError, match="boom after 2") as raised:
            await calls.next("s4")
        assert "ValueError" in raised.value.remote_type and "fails_after" in raised.value.traceback
        assert await running == 2 and len(calls) == 0
    asyncio.run(main())


def test_a_method_that_returns_no_generator_fails_the_first_item():
    async def main():
        store, obj = FakeStore(), Producer()
        calls, running = await started(obj, store, "not_a_generator", "s5")
        with pytest.raises(errors.InvalidArgumentError, match="must return a generator"):
            await calls.next("s5")
        assert obj.ran and await running == 0
    asyncio.run(main())


def test_a_stream_closed_before_it_starts_never_runs_its_method():
    async def main():
        store, obj = FakeStore(), Producer()
        calls = StreamCalls(asyncio.get_running_loop(), store.hold, store.release, 0, "127.0.0.1")
        await calls.close("s6")  # the caller dropped it while the call waited behind others
        runner, _, _ = calls.lookup(STREAM_CALL + "not_a_generator", find(obj), obj)
        assert runner("s6", None, None) == 0
        assert not obj.ran and len(calls) == 0
        await calls.close("never-started", True)  # final: nothing is kept for a start
        assert len(calls) == 0
    asyncio.run(main())


def test_an_async_generator_runs_on_the_loop():
    async def main():
        store, obj = FakeStore(), Producer()
        calls, running = await started(obj, store, "acount", "s7", 3)
        assert [await take(calls, store, "s7") for _ in range(3)] == [0, 1, 2]
        with pytest.raises(errors.OutOfRangeError):
            await calls.next("s7")
        assert await running == 3
    asyncio.run(main())


def test_the_streams_of_an_ended_connection_are_closed():
    async def main():
        store, obj = FakeStore(), Producer()
        calls, running = await started(obj, store, "endless", "s8", bound=1)
        reader = object()

        async def first_item():
            current_connection.set(reader)  # (CallStream.run sets it for its calls)
            return await take(calls, store, "s8")
        assert await asyncio.ensure_future(first_item()) == 0
        calls.connection_ended(reader)
        assert await running >= 1
        assert obj.closed.is_set() and len(calls) == 0
    asyncio.run(main())


def test_ids_bounds_and_one_next_at_a_time(monkeypatch):
    async def main():
        store, obj = FakeStore(), Producer()
        calls = StreamCalls(asyncio.get_running_loop(), store.hold, store.release, 0, "127.0.0.1")
        for bad in ("", "x" * 65, 7, None):
            with pytest.raises(errors.InvalidArgumentError, match="stream id"):
                await calls.next(bad)
        waiting = asyncio.ensure_future(calls.next("s9"))
        await asyncio.sleep(0)
        with pytest.raises(errors.FailedPreconditionError, match="already waiting"):
            await calls.next("s9")
        await calls.close("s9")
        with pytest.raises(errors.OutOfRangeError):
            await waiting
        monkeypatch.setattr(itemstreams, "MAX_STREAMS", 1)
        await calls.close("a")  # a closed stream waiting for its start counts
        with pytest.raises(errors.ResourceExhaustedError, match="streams open"):
            await calls.close("b")
        runner, _, _ = calls.lookup(STREAM_CALL + "count", find(obj), obj)
        with pytest.raises(errors.InvalidArgumentError, match="_generator_backpressure_num_objects"):
            runner("a", 0, None, 1)
        assert calls.lookup(STREAM_NEXT_CALL, find(obj), obj)[1:] == (True, False)
        assert calls.lookup(STREAM_CLOSE_CALL, find(obj), obj)[1:] == (True, False)
        for bad in (STREAM_CALL, STREAM_CALL + "__init__", "__podium_stream_other"):
            with pytest.raises(errors.UnknownMethodError):
                calls.lookup(bad, find(obj), obj)
        with pytest.raises(errors.UnknownMethodError, match="concurrency_groups"):
            runner("c", None, "io", 1)
        assert DEFAULT_BUFFER == itemstreams.ItemStream("x", asyncio.get_running_loop()).bound
    asyncio.run(main())
