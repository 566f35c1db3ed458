"""The worker host's per-method counters (podium.worker.host.methodstats), as Describe
carries them in ``method_stats``.

A call reaches the host's counters on one of four paths: the loop's fast path, the
execution thread reading the socket itself (directcalls), the loop's general path (an
``async def`` method, a bulk argument, a fetched ref argument) and the constructor. Each
test drives them with a real WorkerClient against a real host in-process and checks
each method's row against what was called, and the rows' sums against the host's
per-worker counters (which count the same calls on the same paths).
"""

from __future__ import annotations

import time

import pytest

from podium import errors
from podium.worker.caller.client import WorkerClient
from podium.worker.host.config import FETCH_CALL
from podium.worker.host.methodstats import BUCKET_BOUNDS, CONSTRUCT, MAX_METHODS, OTHER
from podium.worker.host.process import start_host

pytestmark = pytest.mark.timeout(120)


class Service:
    """Hosted object with a method per path."""

    def __init__(self, greeting="hi"):
        self.greeting = greeting

    def ping(self, x):
        return x

    async def aping(self, x):
        return x

    def blob(self, nbytes):
        return b"b" * nbytes

    def fail(self):
        raise ValueError("fails on purpose")

    def nap(self, seconds):
        time.sleep(seconds)


async def _host_and_client(token, cls, same_host=False):
    host = await start_host("127.0.0.1", token=token, env={"RANK": "0", "WORLD_SIZE": "1"})
    client = WorkerClient(host.address, token)
    await client.start()
    client.same_host = same_host
    await client.construct((cls, (), {}))
    return host, client


def _rows(reply):
    return {row.name: row for row in reply.method_stats}


def test_every_path_counts_each_call_under_its_method(token, arun):
    async def scenario():
        host, client = await _host_and_client(token, Service)
        try:
            for i in range(50):  # the fast path, then the execution thread reading the socket
                assert await client.call("ping", (i,)) == i
            for i in range(7):  # the loop's general path
                assert await client.call("aping", (i,)) == i
            assert await client.call("ping", (b"a" * (300 << 10),)) == b"a" * (300 << 10)  # a bulk argument
            assert await client.call("blob", (1 << 20,)) == b"b" * (1 << 20)  # a lent bulk reply
            for _ in range(3):
                with pytest.raises(errors.RemoteError):
                    await client.call("fail")
            with pytest.raises(errors.UnknownMethodError):
                await client.call("no_such_method")
            await client.call("nap", (0.03,))
            reply = await client.describe()
        finally:
            await client.close()
            await host.stop(grace=0.2)
        rows, stats = _rows(reply), reply.stats
        assert set(rows) == {CONSTRUCT, "ping", "aping", "blob", "fail", "nap"}  # no row for a misspelt name
        assert {name: row.count for name, row in rows.items()} == {
            CONSTRUCT: 1, "ping": 51, "aping": 7, "blob": 1, "fail": 3, "nap": 1}
        assert stats["direct_calls"] > 0 and stats["bulk_in"] == 1  # the paths were taken
        for row in rows.values():
            assert list(row.bucket_bounds) == list(BUCKET_BOUNDS)
            assert len(row.bucket_counts) == len(BUCKET_BOUNDS) + 1
            assert sum(row.bucket_counts) == row.count and row.sum_seconds > 0
        # nap slept 30 ms: no bucket with a bound below that holds it
        nap = rows["nap"]
        assert sum(c for b, c in zip(BUCKET_BOUNDS, nap.bucket_counts) if b < 0.03) == 0
        assert nap.sum_seconds >= 0.03
        # The rows add up to the per-worker counters (the constructor is not a call).
        assert sum(row.count for name, row in rows.items() if name != CONSTRUCT) == stats["calls"]
        # (The misspelt call's payload is in bytes_in, counted on arrival, and in no row.)
        assert sum(row.bytes_in for row in rows.values()) < stats["bytes_in"]
        assert sum(row.bytes_out for row in rows.values()) == stats["bytes_out"]
        assert rows["ping"].bytes_in > 300 << 10 and rows["blob"].bytes_out >= 1 << 20
        assert rows["fail"].bytes_out == 0
    arun(scenario())


def test_fetched_ref_arguments_and_held_results_are_counted(token, arun):
    """A held result (hold_result) and a call whose argument is a ref the host fetches."""
    async def scenario():
        host, client = await _host_and_client(token, Service)
        try:
            ref = await client.call("blob", (4096,), hold=True)
            assert await client.call("ping", (ref,)) == b"b" * 4096  # the host fetches its own ref
            assert await client.fetch(ref) == b"b" * 4096  # a peer's fetch: a call of its own
            reply = await client.describe()
        finally:
            await client.close()
            await host.stop(grace=0.2)
        rows = _rows(reply)
        assert rows["blob"].count == 1 and rows["ping"].count == 1
        assert rows["blob"].bytes_out == 0  # a ref went back, not the bytes
        assert rows["ping"].bytes_out >= 4096
        assert rows[FETCH_CALL].count >= 1 and rows[FETCH_CALL].bytes_out >= 4096
    arun(scenario())


def test_methods_past_the_bound_are_counted_under_other(token, arun):
    """100 method names: the constructor and 63 of them keep their own rows (the first
    finished, which may not be the first sent: the loop and the execution thread count
    their own), the rest are counted under ``other``, and a name keeps the row it got."""
    many = type("Many", (), {f"m{i:03d}": (lambda self, i=i: i) for i in range(100)})

    async def scenario():
        host, client = await _host_and_client(token, many)
        try:
            replies = []
            for _ in range(2):
                for i in range(100):
                    assert await client.call(f"m{i:03d}") == i
                replies.append(await client.describe())
            return replies
        finally:
            await client.close()
            await host.stop(grace=0.2)
    first, second = (_rows(reply) for reply in arun(scenario()))
    assert len(first) == MAX_METHODS + 1 and OTHER in first and CONSTRUCT in first
    assert all(first[name].count == 1 for name in first if name not in (OTHER, CONSTRUCT))
    assert first[OTHER].count == 100 - (MAX_METHODS - 1)
    assert set(second) == set(first)  # the same rows: no name moved to or from "other"
    assert all(second[name].count == 2 for name in second if name not in (OTHER, CONSTRUCT))
    assert second[OTHER].count == 2 * first[OTHER].count
    assert sum(row.count for row in second.values()) == 201
