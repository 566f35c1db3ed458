"""``ray.util.queue.Queue`` and ``ray.util.ActorPool``: a Ray program run under ``podium run``.

Plain ``import ray``. Prints one ``name: value`` line per check (test_queue_pool.py reads them)
and ``PROGRAM OK`` at the end. Run it with real Ray to compare: ``python queue_pool_program.py``.
"""

import asyncio
import queue
import time

import ray
from ray.util import ActorPool
from ray.util.queue import Empty, Full, Queue


@ray.remote
class Producer:
    """Puts into a queue whose handle came in its constructor."""

    def __init__(self, q):
        self.q = q

    def produce(self, n):
        for i in range(n):
            self.q.put(("item", i))
        return n


@ray.remote
class AsyncConsumer:
    """Reads a queue with get_async on its own event loop."""

    async def consume(self, q, n):
        got = []
        for _ in range(n):
            got.append(await q.get_async(timeout=30))
        return got


@ray.remote
class Doubler:
    def double(self, x):
        time.sleep(0.05 * (x % 3))
        return 2 * x


def main():
    ray.init()
    q = Queue(maxsize=3)
    print("empty:", q.empty(), q.qsize(), len(q))
    q.put(1)
    q.put_nowait(2)
    q.put(3, timeout=1)
    print("full:", q.full(), q.size())
    for label, call in (("put_nowait when full", lambda: q.put_nowait(4)),
                        ("put timeout when full", lambda: q.put(4, timeout=0.2)),
                        ("put_nowait_batch too many", lambda: q.put_nowait_batch([4]))):
        try:
            call()
            print(f"{label}:", "no error")
        except Full as exc:
            print(f"{label}:", type(exc).__name__, isinstance(exc, queue.Full))
    print("gets:", q.get(), q.get_nowait(), q.get(block=False))
    for label, call in (("get_nowait when empty", q.get_nowait),
                        ("get timeout when empty", lambda: q.get(timeout=0.2)),
                        ("get_nowait_batch too many", lambda: q.get_nowait_batch(1))):
        try:
            call()
            print(f"{label}:", "no error")
        except Empty as exc:
            print(f"{label}:", type(exc).__name__, isinstance(exc, queue.Empty))
    q.put_nowait_batch(["a", "b"])
    print("get_nowait_batch:", q.get_nowait_batch(2))

    # A get that waits for a put made later, from another actor that got the queue's handle.
    unbounded = Queue()
    producer = Producer.remote(unbounded)
    done = producer.produce.remote(5)
    print("cross-process:", [unbounded.get(timeout=30) for _ in range(5)], ray.get(done))

    # get_async in an actor that got the queue as an argument, fed from the driver.
    consumer = AsyncConsumer.remote()
    pending = consumer.consume.remote(unbounded, 3)
    for i in range(3):
        unbounded.put(i * 10)
    print("async get in actor:", ray.get(pending))

    async def driver_async():
        await unbounded.put_async("x")
        return await unbounded.get_async()

    print("driver async:", asyncio.run(driver_async()))
    unbounded.shutdown()
    try:
        unbounded.put(1)
        print("after shutdown:", "no error")
    except ValueError as exc:
        print("after shutdown:", "shut down" in str(exc))

    pool = ActorPool([Doubler.remote() for _ in range(2)])
    print("map:", list(pool.map(lambda a, v: a.double.remote(v), range(8))))
    print("map_unordered:", sorted(pool.map_unordered(lambda a, v: a.double.remote(v), range(8))))
    for v in range(5):
        pool.submit(lambda a, v: a.double.remote(v), v)
    print("has_free while busy:", pool.has_free())
    ordered = []
    while pool.has_next():
        ordered.append(pool.get_next())
    print("submit/get_next:", ordered)
    pool.submit(lambda a, v: a.double.remote(v), 21)
    pool.submit(lambda a, v: a.double.remote(v), 4)
    print("get_next_unordered:", sorted([pool.get_next_unordered(), pool.get_next_unordered()]))
    idle = pool.pop_idle()
    print("pop_idle:", idle is not None, pool.has_free())
    print("one actor left:", list(pool.map(lambda a, v: a.double.remote(v), [1, 2, 3])))
    pool.push(idle)
    try:
        pool.push(idle)
        print("push twice:", "no error")
    except ValueError as exc:
        print("push twice:", "already belongs" in str(exc))
    print("has_next at end:", pool.has_next())
    print("PROGRAM OK")


if __name__ == "__main__":
    main()
