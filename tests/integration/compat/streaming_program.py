"""Run under ``podium run --num-cpus 8``: ``num_returns="streaming"`` with plain ``import ray``:
tasks, sync and async actor methods, sync and async iteration, items that arrive as they are
yielded, an error mid-stream, an actor that dies mid-stream, a dropped generator, the buffer's
bound. Prints ``STREAMING OK`` last.

"As they are yielded" is shown without a clock: each producer yields item 0 and then waits on a
latch that only the consumer opens, after it received item 0."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time

import ray
from ray._raylet import ObjectRefGenerator as RayletGenerator
from ray._raylet import StreamingObjectRefGenerator

ray.init()


@ray.remote(max_concurrency=4, num_cpus=0.1)  # (many are made: they take little of the 8 CPUs)
class Latch:
    """Opened by the consumer; producers wait on it (a thread each: max_concurrency)."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.closed = 0

    def open(self) -> None:
        self.opened.set()

    def wait(self) -> bool:
        return self.opened.wait()

    def generator_closed(self) -> None:
        self.closed += 1

    def closed_count(self) -> int:
        return self.closed


def new_latch():
    """A Latch, built before its handle travels: a call through a borrowed handle that reaches
    the worker before its owner's CONSTRUCT fails (a race of Podium's, not of streaming)."""
    latch = Latch.remote()
    ray.get(latch.closed_count.remote())
    return latch


@ray.remote
def latched_task(latch):
    yield "first"
    ray.get(latch.wait.remote())
    yield "second"


@ray.remote
def count(n):
    for i in range(n):
        yield i


@ray.remote
def add(a, b):
    return a + b


@ray.remote
class Sync:  # one call at a time (Ray's default): its next calls must not wait behind its generator
    def latched(self, latch):
        yield "first"
        ray.get(latch.wait.remote())
        yield "second"

    def fails_after(self, k):
        for i in range(k):
            yield i
        raise ValueError(f"boom after {k}")

    def dies_after_first(self, latch):
        yield "first"
        ray.get(latch.wait.remote())
        os._exit(7)

    def endless(self, latch):
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:  # GeneratorExit at the yield once the caller dropped the stream
            ray.get(latch.generator_closed.remote())

    @ray.method(num_returns="streaming")
    def not_a_generator(self):
        return 5

    def ping(self):
        return "pong"


@ray.remote
class Async:
    def __init__(self) -> None:
        self.resumed = 0

    async def latched(self, latch):
        yield "first"
        await latch.wait.remote()
        yield "second"

    async def counted(self, n):
        for i in range(n):
            yield i
            self.resumed += 1

    async def resumed_count(self) -> int:
        return self.resumed


def latched(make):
    """Item 0 arrives while the producer waits for what only this consumer does next."""
    latch = new_latch()
    gen = make(latch)
    first = next(gen)
    assert ray.get(first) == "first"
    assert not gen.next_ready() and not gen.is_finished()
    latch.open.remote()
    assert ray.get(next(gen)) == "second"
    try:
        next(gen)
    except StopIteration:
        pass
    else:
        raise AssertionError("a third item")
    assert gen.is_finished()


print("step: Tasks", flush=True)
# Tasks: a generator function streams by default (Ray's rule), and with the option.
gen = count.remote(3)
assert isinstance(gen, ray.ObjectRefGenerator) and isinstance(gen, StreamingObjectRefGenerator)
assert RayletGenerator is ray.ObjectRefGenerator
assert [ray.get(ref) for ref in gen] == [0, 1, 2]
refs = list(count.options(num_returns="streaming").remote(4))
assert ray.get(refs) == [0, 1, 2, 3]
assert ray.get(add.remote(refs[1], refs[3])) == 4  # a streamed ref is an argument like any other
latched(lambda latch: latched_task.remote(latch))

print("step: A sync actor", flush=True)
# A sync actor (max_concurrency=1) and an async one; .options and the default alike.
sync = Sync.remote()
latched(lambda latch: sync.latched.remote(latch))
latched(lambda latch: sync.latched.options(num_returns="streaming").remote(latch))
asynchronous = Async.remote()
latched(lambda latch: asynchronous.latched.remote(latch))
named = Sync.options(name="streams", max_concurrency=2).remote()  # (in threads of its own)
looked_up = ray.get_actor("streams")  # knows its generator methods from the worker (Describe)
latched(lambda latch: looked_up.latched.remote(latch))


async def async_iteration() -> None:
    gen = asynchronous.counted.remote(3)
    assert [await ref async for ref in gen] == [0, 1, 2]
    latch = new_latch()
    gen = asynchronous.latched.remote(latch)
    assert await (await gen.__anext__()) == "first"
    latch.open.remote()
    assert await (await gen.__anext__()) == "second"
    try:
        await gen.__anext__()
    except StopAsyncIteration:
        pass
    else:
        raise AssertionError("a third item")

asyncio.run(async_iteration())


@ray.remote(concurrency_groups={"io": 1})
class Grouped:
    @ray.method(concurrency_group="io")
    async def in_io(self, n):
        for i in range(n):
            yield i

    async def in_default(self, n):
        for i in range(n):
            yield -i


grouped = Grouped.remote()
assert [ray.get(r) for r in grouped.in_io.remote(3)] == [0, 1, 2]
assert [ray.get(r) for r in grouped.in_default.options(concurrency_group="io").remote(2)] == [0, -1]


@ray.remote
def consume(actor) -> list:  # a handle passed to a task streams there as in the driver
    return [ray.get(ref) for ref in actor.counted.remote(3)]


assert ray.get(consume.remote(Async.remote())) == [0, 1, 2]

print("step: An error after k", flush=True)
# An error after k items: items 0..k-1 are fine, the next ref raises it, then the end.
refs = list(sync.fails_after.remote(2))
assert len(refs) == 3 and ray.get(refs[:2]) == [0, 1]
try:
    ray.get(refs[2])
except ray.exceptions.RayTaskError as exc:
    assert "boom after 2" in str(exc), str(exc)
else:
    raise AssertionError("the error was not raised")
refs = list(sync.not_a_generator.remote())
assert len(refs) == 1
try:
    ray.get(refs[0])
except Exception as exc:  # noqa: BLE001 - the text is checked
    assert "must return a generator" in str(exc), str(exc)
else:
    raise AssertionError("a method that returns no generator was not refused")
assert ray.get(sync.ping.remote()) == "pong"

print("step: The actor dies mid-stream", flush=True)
# The actor dies mid-stream: the next ref raises ActorDiedError with the reason, no hang.
doomed = Sync.remote()
latch = new_latch()
gen = doomed.dies_after_first.remote(latch)
assert ray.get(next(gen)) == "first"
latch.open.remote()
died = list(gen)
assert len(died) == 1
try:
    ray.get(died[0])
except ray.exceptions.ActorDiedError as exc:
    assert "7" in str(exc), str(exc)
else:
    raise AssertionError("the actor's death was not raised")

print("step: A dropped generator", flush=True)
# A dropped generator is closed at the worker: its generator sees GeneratorExit, and the
# actor (one call at a time) is free for the next call.
latch = new_latch()
gen = sync.endless.options(_generator_backpressure_num_objects=2).remote(latch)
assert ray.get(next(gen)) == 0
del gen
gc.collect()
for _ in range(600):
    if ray.get(latch.closed_count.remote()) == 1:
        break
    time.sleep(0.05)
assert ray.get(latch.closed_count.remote()) == 1, "the dropped stream's generator was not closed"
assert ray.get(sync.ping.remote()) == "pong"

print("step: The bound", flush=True)
# The bound: a producer waits at its yield when that many items are not taken (2 buffered,
# one handed to the caller's next in flight: it resumed after 3 yields).
counter = Async.remote()
gen = counter.counted.options(num_returns="streaming", _generator_backpressure_num_objects=2).remote(100)
for _ in range(600):
    if ray.get(counter.resumed_count.remote()) >= 3:
        break
    time.sleep(0.05)
time.sleep(0.5)  # room to run further, were it not bounded
assert ray.get(counter.resumed_count.remote()) == 3, ray.get(counter.resumed_count.remote())
assert [ray.get(next(gen)) for _ in range(5)] == [0, 1, 2, 3, 4]
del gen

print("step: Refused forms", flush=True)
# Refused forms name the alternative.
for form in (lambda: sync.fails_after.options(max_task_retries=2).remote(1),
             lambda: count.options(max_retries=5).remote(1)):
    try:
        form()
    except NotImplementedError as exc:
        assert "not retried" in str(exc), str(exc)
    else:
        raise AssertionError("a retried stream was accepted")
print("STREAMING OK")
