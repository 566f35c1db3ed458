"""Held results no call took along are released in batches, one RPC per worker, whatever
thread drops the refs (the ride on the next call: tests/integration/controller/test_call_bursts.py)."""

from __future__ import annotations

import asyncio
import collections
import threading
import types

from podium.controller.session.releaser import Releaser
from tests.support.waiting import eventually_async


class FakeClient:
    """A worker client and its channel in one: the releaser sends through ``client.channel``."""

    def __init__(self):
        self.calls = []
        self.releasable = collections.deque()
        self.channel = self

    async def release(self, ids):
        self.calls.append(list(ids))
        return len(ids)


def test_ids_from_many_threads_go_out_in_one_rpc_per_client():
    async def main():
        loop = asyncio.get_running_loop()
        rt = types.SimpleNamespace(loop=loop, closed=False, stats={})
        releaser = Releaser(rt)
        a, b = FakeClient(), FakeClient()

        def drop(client, prefix):
            for i in range(500):
                releaser.add(client, f"{prefix}-{i}")

        threads = [threading.Thread(target=drop, args=(a, "a")), threading.Thread(target=drop, args=(b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        await eventually_async(lambda: rt.stats.get("released") == 1000, "all 1,000 ids released")
        return rt, a, b

    rt, a, b = asyncio.run(main())
    assert sorted(i for call in a.calls for i in call) == sorted(f"a-{i}" for i in range(500))
    assert sorted(i for call in b.calls for i in call) == sorted(f"b-{i}" for i in range(500))
    assert len(a.calls) <= 3 and len(b.calls) <= 3  # batched, not one RPC per id
    assert rt.stats["released"] == 1000


def test_an_add_inside_an_add_neither_deadlocks_nor_loses_ids():
    # What the cyclic collector can do: run a PendingRef's finalizer in the middle of add().
    async def main():
        loop = asyncio.get_running_loop()
        client = FakeClient()

        class ReentrantLoop:
            nested = False

            def call_soon_threadsafe(self, fn):
                if not self.nested:
                    self.nested = True
                    releaser.add(client, "inner")  # an add while the outer one is running
                return loop.call_soon_threadsafe(fn)

            def call_later(self, delay, fn):
                return loop.call_later(delay, fn)

            def create_task(self, coro):
                return loop.create_task(coro)

        rt = types.SimpleNamespace(loop=ReentrantLoop(), closed=False, stats={})
        releaser = Releaser(rt)
        releaser.add(client, "outer")
        await eventually_async(lambda: len(sum(client.calls, [])) == 2, "the outer and inner ids released")
        releaser.add(client, "later")
        await eventually_async(lambda: len(sum(client.calls, [])) == 3, "the later id released")
        return client

    client = asyncio.run(main())
    assert sorted(i for call in client.calls for i in call) == ["inner", "later", "outer"]


def test_ids_a_call_took_along_are_not_sent_again():
    async def main():
        loop = asyncio.get_running_loop()
        rt = types.SimpleNamespace(loop=loop, closed=False, stats={})
        releaser = Releaser(rt)
        client = FakeClient()
        for i in range(4):
            releaser.add(client, f"id-{i}")
        taken = [client.releasable.popleft() for _ in range(3)]  # what the next call frame does
        await eventually_async(lambda: client.calls, "the leftover flushed")
        await asyncio.sleep(0.2)
        return taken, client

    taken, client = asyncio.run(main())
    assert taken == ["id-0", "id-1", "id-2"] and client.calls == [["id-3"]]
