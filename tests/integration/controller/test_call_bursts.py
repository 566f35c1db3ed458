"""Bursts of calls settling sinks (WorkerClient.submit_into, what blocking=False group calls
use), and the client's one deadline timer: a real worker host in-process, real sockets."""

from __future__ import annotations

import asyncio
import time

import pytest

from podium import errors
from podium.controller.session.futures import PendingRef
from podium.refs import ObjectRef, inline_value
from podium.worker.caller.client import WorkerClient, prepare
from podium.worker.host.process import start_host
from tests.support.waiting import eventually_async

pytestmark = pytest.mark.timeout(120)


class Counter:
    """Hosted object: counts calls, can fail and sleep."""

    def __init__(self):
        self.n = 0

    def bump(self):
        self.n += 1
        return self.n

    def noop(self):
        return None

    def echo_len(self, data):
        return len(data)

    def boom(self):
        raise ValueError("boom")

    def nap(self, seconds):
        self.napping = True  # the test reads it through host.runtime.hosted
        time.sleep(seconds)
        return seconds

    def record(self, item):
        self.seen = getattr(self, "seen", []) + [item]

    async def arecord(self, item):
        self.record(item)

    def seen_items(self):
        return getattr(self, "seen", [])

    def zeros(self, n):
        import torch
        return torch.zeros(n, dtype=torch.int64)


async def _started(token):
    host = await start_host("127.0.0.1", token=token, env={"RANK": "0", "WORLD_SIZE": "1"})
    client = WorkerClient(host.address, token)
    await client.start()
    await client.construct((Counter, (), {}))
    return host, client


def test_a_burst_settles_every_sink_in_call_order(token, arun):
    async def scenario():
        host, client = await _started(token)
        failures = []
        try:
            assert client.transport == "socket"
            no_args = prepare(((), {}))
            sinks = [PendingRef(0, "bump") for _ in range(500)]
            for sink in sinks:
                client.submit_into("bump", no_args, sink, lambda s, e: failures.append((s, e)), hold=True,
                                   timeout=60)
            deadline = time.monotonic() + 60
            while not all(s.done() for s in sinks) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            refs = [s.ref(timeout=0) for s in sinks]
            assert failures == [] and all(isinstance(r, ObjectRef) for r in refs)
            assert [inline_value(r) for r in refs] == list(range(1, 501))  # ran in call order
            assert client.pending == 0
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())


def test_released_ids_ride_on_the_next_call_frame(token, arun):
    # No Releaser and no Release RPC here: only the next call can carry the ids.
    async def scenario():
        host, client = await _started(token)
        failures = []
        try:
            held = host.runtime.held
            sinks = [PendingRef(0, "bump") for _ in range(5)]
            for sink in sinks:
                client.submit_into("bump", prepare(((), {})), sink, lambda s, e: failures.append(e), hold=True,
                                   timeout=60)
            await eventually_async(lambda: all(s.done() for s in sinks), "the held calls", 60)
            refs = [s.ref(timeout=0) for s in sinks]
            assert len(held) == 5 and failures == []
            client.releasable.extend(r.object_id for r in refs[:3])
            # a small call frame (a cached tail plus the ids' suffix)
            assert await client.submit("noop", prepare(((), {})), timeout=60) is None
            assert len(client.releasable) == 0 and sorted(held._objects) == sorted(r.object_id for r in refs[3:])
            # a bulk frame (its header built per call) carries them too
            client.releasable.extend(r.object_id for r in refs[3:])
            big = prepare(((b"x" * (256 << 10),), {}))
            assert await client.submit("echo_len", big, timeout=60) == 256 << 10
            assert len(held) == 0
            # an id the worker never held (or released already) is ignored
            client.releasable.append(refs[0].object_id)
            assert await client.call("bump") == 6
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())


def test_errors_reach_on_error_and_the_stream_goes_on(token, arun):
    async def scenario():
        host, client = await _started(token)
        try:
            failed = asyncio.get_running_loop().create_future()
            sink = PendingRef(0, "boom")
            client.submit_into("boom", prepare(((), {})), sink, lambda s, e: failed.set_result((s, e)),
                               hold=True, timeout=60)
            got_sink, exc = await asyncio.wait_for(failed, 30)
            assert got_sink is sink and isinstance(exc, errors.RemoteError) and "boom" in exc.traceback
            assert not sink.done()  # on_error decides what the sink gets
            assert await client.call("bump") == 1
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())


def test_a_short_deadline_expires_on_time_behind_a_long_one(token, arun):
    async def scenario():
        host, client = await _started(token)
        try:
            # The first call holds the execution thread for 3 s with an hour's deadline;
            # the second waits behind it and must fail at its own 0.3 s, not when the first
            # ends: the first is still running when the second's error arrives.
            slow = client.submit("nap", prepare(((3.0,), {})), timeout=3600)
            with pytest.raises(errors.DeadlineExceededError, match="noop"):
                await asyncio.wait_for(client.submit("noop", prepare(((), {})), timeout=0.3), 30)
            assert not slow.done()
            assert await asyncio.wait_for(slow, 30) == 3.0  # the long one is untouched
            # a sink gets its deadline through on_error, and later calls still expire
            expired = asyncio.get_running_loop().create_future()
            client.submit("nap", prepare(((1.0,), {})), timeout=3600)
            client.submit_into("noop", prepare(((), {})), PendingRef(0, "noop"),
                               lambda s, e: expired.set_result(e), hold=True, timeout=0.2)
            assert isinstance(await asyncio.wait_for(expired, 30), errors.DeadlineExceededError)
            assert await client.call("bump", timeout=30) == 1
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())


def test_closing_the_client_fails_unsettled_sinks(token, arun):
    async def scenario():
        host, client = await _started(token)
        try:
            failed = asyncio.get_running_loop().create_future()
            client.submit_into("nap", prepare(((2.0,), {})), PendingRef(0, "nap"),
                               lambda s, e: failed.set_result(e), hold=True, timeout=60)
            await eventually_async(lambda: getattr(host.runtime.hosted, "napping", False), "the nap to start")
            await client.close()
            assert isinstance(await asyncio.wait_for(failed, 10), errors.UnavailableError)
        finally:
            await host.stop(grace=0.2)
    arun(scenario())


def test_fast_and_general_calls_keep_call_order_and_stats(token, arun):
    async def scenario():
        host, client = await _started(token)
        try:
            stats = host.runtime.stats_now  # counted at the loop's next wake-up: settled here
            calls_before = stats()["calls"]
            # a result held here, passed back as an argument: that call fetches it first
            # (the general path), and every later call must still run after it
            held = await client.call("bump", hold=True)
            futures = []
            for i in range(60):
                if i % 20 == 5:
                    futures.append(client.submit("record", prepare(((held,), {}))))
                elif i % 20 == 12:
                    futures.append(client.submit("arecord", prepare(((i,), {}))))
                else:
                    futures.append(client.submit("record", prepare(((i,), {}))))
            await asyncio.wait_for(asyncio.gather(*futures), 60)
            expected = [1 if i % 20 == 5 else i for i in range(60)]
            seen = await client.call("seen_items")
            # async methods run on the loop, in arrival order among themselves only
            assert [x for x in seen if x not in (12, 32, 52)] == [x for x in expected if x not in (12, 32, 52)]
            assert sorted(seen) == sorted(expected)
            assert stats()["calls"] - calls_before == 62 and stats()["calls_in_flight"] == 0
            errors_before = stats()["call_errors"]
            with pytest.raises(errors.RemoteError, match="boom"):
                await client.call("boom")
            assert stats()["call_errors"] == errors_before + 1 and stats()["calls_in_flight"] == 0
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())


def test_a_large_result_of_a_one_frame_call_streams_back(token, arun):
    async def scenario():
        host, client = await _started(token)
        try:
            client.same_host = False  # TCP: the 24 MiB reply goes out in several frames
            out = await asyncio.wait_for(client.submit("zeros", prepare(((3_000_000,), {})), timeout=60), 60)
            assert out.shape == (3_000_000,) and int(out.sum()) == 0
            assert await client.call("bump") == 1
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())


def test_a_call_cancelled_before_it_started_never_runs(token, arun):
    async def scenario():
        host, client = await _started(token)
        try:
            blocker = client.submit("nap", prepare(((1.0,), {})), timeout=60)
            await asyncio.sleep(0.1)  # the nap holds the execution thread
            with pytest.raises(errors.DeadlineExceededError):
                await client.submit("bump", prepare(((), {})), timeout=0.2)
            await asyncio.wait_for(blocker, 30)
            # the expired call was cancelled in the worker before it started: not counted
            assert await client.call("bump") == 1
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())
