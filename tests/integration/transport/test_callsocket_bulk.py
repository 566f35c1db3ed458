"""Bulk frames on the raw call socket, between two real FrameConnections on loopback.

A bulk frame is a message followed by a whole payload, read straight into a mapping of
the process's memory pool. These check the bytes at every boundary (a bulk right after
small frames, back to back, one that arrives in the frame buffer with its message), that
a payload over the receiver's limit is refused before any memory is taken while the
connection carries on, and that a connection cut mid-payload gives its mapping back.
"""

from __future__ import annotations

import asyncio
import gc
import os

import grpc
import pytest

from podium import errors
from podium.memorypool import POOL
from podium.transport import callsocket
from podium.transport.callsocket import BulkFrame
from podium.transport.chunks import RECEIVING
from podium.v1 import worker_pb2

TOKEN = "bulk-token"
pytestmark = pytest.mark.timeout(120)


def frame(call_id: int, size: int = 0, data: bytes = b"") -> bytes:
    header = worker_pb2.CallHeader(kind=worker_pb2.CALL, method="m", payload_size=size or len(data))
    return worker_pb2.CallFrame(call_id=call_id, header=header, data=data, last=True).SerializeToString()


async def pair(max_bulk: int):
    """A server connection (frames read with read()) and a client connection to it."""
    accepted: asyncio.Queue = asyncio.Queue()
    server, port = await callsocket.serve("127.0.0.1", TOKEN, worker_pb2.CallFrame.FromString,
                                          accepted.put_nowait, max_bulk=max_bulk)
    lost: asyncio.Future = asyncio.get_running_loop().create_future()
    client = await callsocket.connect("127.0.0.1", port, TOKEN, worker_pb2.ReplyFrame.FromString,
                                      lambda f: None, lambda exc: lost.done() or lost.set_result(exc))
    conn = await asyncio.wait_for(accepted.get(), 10)
    return server, client, conn


async def read(conn, timeout: float = 30.0):
    got = await asyncio.wait_for(conn.read(), timeout)
    assert got is not None
    return got


def test_bulk_payloads_arrive_intact_at_every_boundary():
    async def go():
        server, client, conn = await pair(max_bulk=64 << 20)
        payloads = [os.urandom(n) for n in (64 << 10, 1, 5 << 20, (17 << 20) + 3, 200)]
        try:
            client.write_serialized_nowait(frame(1, data=b"small"))       # a plain frame first
            for i, payload in enumerate(payloads, start=2):               # then bulks back to back
                view = memoryview(payload)
                client.write_bulk(frame(i, size=len(payload)), [view[:7], view[7:]], len(payload))
            client.write_serialized_nowait(frame(99, data=b"after"))
            first = await read(conn)
            assert not isinstance(first, BulkFrame) and first.data == b"small"
            for i, payload in enumerate(payloads, start=2):
                got = await read(conn)
                assert isinstance(got, BulkFrame) and got.error is None
                assert got.message.call_id == i and got.message.header.payload_size == len(payload)
                assert not got.data.readonly and bytes(got.data) == payload
            last = await read(conn)
            assert last.call_id == 99 and last.data == b"after"
        finally:
            client.close()
            server.close()

    asyncio.run(go())


def test_a_bulk_over_the_limit_is_refused_before_memory_is_taken_and_the_connection_goes_on():
    async def go():
        server, client, conn = await pair(max_bulk=1 << 20)
        try:
            made = POOL.created
            payload = os.urandom(3 << 20)
            client.write_bulk(frame(1, size=len(payload)), [memoryview(payload)], len(payload))
            client.write_serialized_nowait(frame(2, data=b"next"))
            refused = await read(conn)
            assert isinstance(refused, BulkFrame) and refused.data is None
            assert isinstance(refused.error, errors.PayloadTooLargeError)
            assert "maximum of 1048576 bytes" in str(refused.error)
            assert POOL.created == made  # nothing was allocated for it
            following = await read(conn)
            assert following.call_id == 2 and following.data == b"next"
        finally:
            client.close()
            server.close()

    asyncio.run(go())


def test_a_connection_cut_mid_payload_gives_the_mapping_back():
    async def go():
        server, client, conn = await pair(max_bulk=64 << 20)
        try:
            POOL.clear()
            size = 32 << 20
            part = os.urandom(2 << 20)
            client.write_bulk(frame(1, size=size), [memoryview(part)], size)  # announces more than it sends
            for _ in range(200):  # until the server has begun receiving into the mapping
                if conn._bulk is not None and conn._bulk.received > 0:
                    break
                await asyncio.sleep(0.02)
            assert conn._bulk is not None
            client.close()
            assert await asyncio.wait_for(conn.read(), 30) is grpc.aio.EOF  # never a partial frame
            assert conn.closed and isinstance(conn.lost_error, errors.DataLossError)
            assert POOL.idle_bytes >= size  # the mapping came back; nothing leaked
        finally:
            server.close()

    asyncio.run(go())


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_payloads_in_flight_on_all_connections_together_stay_within_the_process_bound(monkeypatch):
    async def go():
        monkeypatch.setattr(RECEIVING, "limit", 8 << 20)
        server_a, client_a, conn_a = await pair(max_bulk=64 << 20)
        server_b, client_b, conn_b = await pair(max_bulk=64 << 20)
        try:
            size = 6 << 20
            first = os.urandom(size)
            client_a.write_bulk(frame(1, size=size), [memoryview(first)[:1 << 20]], size)  # the rest later
            for _ in range(500):  # until A's payload is being received (and counted)
                if conn_a._bulk is not None and conn_a._bulk.received > 0:
                    break
                await asyncio.sleep(0.02)
            assert RECEIVING.held == size
            second = os.urandom(size)
            client_b.write_bulk(frame(2, size=size), [memoryview(second)], size)
            client_b.write_serialized_nowait(frame(3, data=b"next"))
            refused = await read(conn_b)  # both together would pass the process's bound
            assert isinstance(refused, BulkFrame) and isinstance(refused.error, errors.ResourceExhaustedError)
            assert "this process's unfinished payloads" in str(refused.error)
            assert (await read(conn_b)).data == b"next"  # the connection goes on
            client_a._transport.write(first[1 << 20:])  # the rest of A's payload
            done = await read(conn_a)
            assert done.error is None and bytes(done.data) == first
            client_b.write_bulk(frame(4, size=size), [memoryview(second)], size)  # room again
            again = await read(conn_b)
            assert again.error is None and bytes(again.data) == second
            del done, again
            assert RECEIVING.held == 0
        finally:
            for closing in (client_a, client_b, server_a, server_b):
                closing.close()

    asyncio.run(go())


def test_the_pages_a_peer_filled_go_back_when_its_connection_ends():
    async def go():
        server, client, conn = await pair(max_bulk=256 << 20)
        try:
            POOL.clear()
            size = 96 << 20
            payload = os.urandom(size)
            client.write_bulk(frame(1, size=size), [memoryview(payload)], size)
            got = await read(conn)
            assert got.error is None and got.data.nbytes == size
            del got  # the lease ends: the mapping is free again, its pages still resident
            gc.collect()
            assert POOL.idle_bytes >= size
            resident = rss_bytes()
            client.close()
            assert await asyncio.wait_for(conn.read(), 30) is grpc.aio.EOF
            conn.close()  # as the worker's call stream does at EOF
            for _ in range(500):
                if conn.closed:
                    break
                await asyncio.sleep(0.02)
            assert conn.closed
            assert resident - rss_bytes() >= size // 2  # the peer left: its pages went with it
            assert POOL.idle_bytes >= size  # the mapping itself stays for reuse
        finally:
            server.close()

    asyncio.run(go())
