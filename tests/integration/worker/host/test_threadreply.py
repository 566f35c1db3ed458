"""Replies sent by the execution thread itself (ThreadLoan.write_from_thread).

A no-op call used to wake a worker's event loop twice: once for the call's frame, once for
the execution thread's outcome. A small reply now leaves from the execution thread on a
second descriptor of the socket, ordered with the loop's own writes by a lock; the loop
counts it at its next wake-up. These tests check the bytes on the wire (whole, in order,
also when the socket takes only part of a message), that the counters still add up, and
that closing the connection still reaches the peer.

A real worker host in-process and real WorkerClients, or a real FrameConnection pair, on
loopback TCP.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from podium import codec
from podium.transport import callsocket
from podium.v1 import worker_pb2
from podium.worker.caller.client import WorkerClient, prepare
from podium.worker.host.process import start_host

pytestmark = pytest.mark.timeout(120)


class Echo:
    """Hosted object: small results, None, and an error."""

    def same(self, x):
        return x

    def nothing(self):
        return None

    def boom(self):
        raise ValueError("boom")


async def _host_and_client(token, tls=None):
    host = await start_host("127.0.0.1", token=token, env={"RANK": "0", "WORLD_SIZE": "1"}, tls=tls)
    client = WorkerClient(host.address, token, tls=tls)
    await client.start()
    client.same_host = False
    await client.construct((Echo, (), {}))
    return host, client


def test_small_replies_leave_from_the_execution_thread_whole_and_counted(token, arun):
    async def scenario():
        host, client = await _host_and_client(token)
        try:
            assert client.transport == "socket"
            # Pipelined: the thread's sends and the loop's writes (errors, bookkeeping) mix.
            futures = [client.submit("same", prepare((((i, "x" * (i % 50)),), {}))) for i in range(300)]
            futures += [client.submit("nothing", prepare(((), {}))) for _ in range(100)]
            futures.append(client.submit("boom", prepare(((), {}))))
            done = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 60)
            assert done[:300] == [(i, "x" * (i % 50)) for i in range(300)]
            assert done[300:400] == [None] * 100
            assert "boom" in str(done[400])
            stats = (await client.describe()).stats  # counted once the loop has settled them
            assert stats["calls_in_flight"] == 0
            assert stats["thread_replies"] >= 350  # a few may meet a busy socket and go from the loop
            assert stats["call_errors"] == 1
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())


def test_calls_in_flight_when_the_client_half_closes_still_answer(token, arun):
    """A client sends a burst and closes its side at once: the worker answers every call
    (from the execution thread too) before it closes the connection."""
    async def scenario():
        host, client = await _host_and_client(token)
        try:
            port = host.runtime.call_port

            def burst() -> list[int]:
                hello = struct.pack("<4sBH", callsocket.MAGIC, callsocket.VERSION, len(token)) + token.encode()
                frames = b""
                for call_id in range(1, 201):
                    data = b"".join(prepare((((call_id,),), {})).segments())
                    frame = worker_pb2.CallFrame(call_id=call_id, data=data, last=True, header=worker_pb2.CallHeader(
                        kind=worker_pb2.CALL, method="same", payload_size=len(data))).SerializeToString()
                    frames += struct.pack("<I", len(frame)) + frame
                with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                    sock.sendall(hello + frames)
                    sock.shutdown(socket.SHUT_WR)
                    received = b""
                    while chunk := sock.recv(1 << 16):
                        received += chunk
                assert received[:1] == b"\x00"  # accepted
                ids, at = [], 1
                while at < len(received):
                    (length,) = struct.unpack_from("<I", received, at)
                    reply = worker_pb2.ReplyFrame.FromString(received[at + 4:at + 4 + length])
                    assert reply.header.ok and codec.decode(reply.data) == (reply.call_id,)
                    ids.append(reply.call_id)
                    at += 4 + length
                return ids

            assert sorted(await asyncio.to_thread(burst)) == list(range(1, 201))
            stats = host.runtime.stats_now()
            assert stats["calls_in_flight"] == 0 and stats["thread_replies"] > 0
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())


def test_replies_go_from_the_loop_under_tls(token, arun, tmp_path):
    from tests.support.certs import make_tls

    tls = make_tls(str(tmp_path / "certs"))

    async def scenario():
        host, client = await _host_and_client(token, tls=tls)
        try:
            assert client.transport == "socket"
            assert await client.call("same", (7,)) == 7
            assert host.runtime.stats_now()["thread_replies"] == 0  # uvloop encrypts: the loop writes
            connection = next(iter(host.runtime.raw_connections))
            assert connection.loan.write_from_thread(b"x") is False
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())


async def _pair(token):
    """A connected (server FrameConnection, client FrameConnection, frames the client got)."""
    accepted: asyncio.Future = asyncio.get_running_loop().create_future()
    got: list = []
    lost: asyncio.Future = asyncio.get_running_loop().create_future()
    server, port = await callsocket.serve("127.0.0.1", token, worker_pb2.CallFrame.FromString,
                                          accepted.set_result, max_bulk=1 << 20)
    client = await callsocket.connect("127.0.0.1", port, token, worker_pb2.ReplyFrame.FromString,
                                      got.append, lambda exc: lost.done() or lost.set_result(exc))
    conn = await asyncio.wait_for(accepted, 10)
    return server, conn, client, got, lost


async def _until(condition, seconds: float = 10.0) -> None:
    """Wait (on the loop) until ``condition()``; fails the test after ``seconds``."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def _reply(call_id: int, size: int) -> bytes:
    return worker_pb2.ReplyFrame(call_id=call_id, data=bytes([call_id % 256]) * size,
                                 last=True).SerializeToString()


def test_what_the_socket_did_not_take_goes_first_and_in_order(token, arun):
    async def scenario():
        server, conn, client, got, _ = await _pair(token)
        try:
            # The peer stops reading and the send buffer is small: a 3 MiB message is only
            # partly taken by the kernel. (Written here on the loop's own thread, so that the
            # loop's next write comes before the rest's callback could run.)
            client._transport.pause_reading()
            conn._transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            assert conn.loan.write_from_thread(_reply(1, 3 << 20)) is True
            # Nothing may pass the rest: another such write is refused, and a loop write
            # (large, so written at once) goes out behind it.
            assert conn.loan.write_from_thread(_reply(2, 10)) is False
            conn.write_serialized_nowait(_reply(3, 100 << 10))
            assert conn._transport.get_write_buffer_size() > (3 << 20) // 2  # the rest, then 3
            client._transport.resume_reading()
            await _until(lambda: len(got) == 2)
            assert [(f.call_id, len(f.data)) for f in got] == [(1, 3 << 20), (3, 100 << 10)]
            assert got[0].data == bytes([1]) * (3 << 20)
            # Once nothing is queued, a write from another thread goes straight out again.
            await _until(lambda: not conn._transport.get_write_buffer_size())
            assert await asyncio.to_thread(conn.loan.write_from_thread, _reply(4, 10)) is True
            await _until(lambda: len(got) == 3)
            assert got[2].call_id == 4
        finally:
            client.close()
            conn.close()
            server.close()
    arun(scenario())


def test_closing_the_connection_reaches_the_peer_and_ends_thread_writes(token, arun):
    async def scenario():
        server, conn, client, got, lost = await _pair(token)
        try:
            assert await asyncio.to_thread(conn.loan.write_from_thread, _reply(1, 10)) is True
            conn.close()  # the second descriptor must not keep the socket open
            await asyncio.wait_for(lost, 10)
            assert [f.call_id for f in got] == [1]
            assert conn.loan.write_from_thread(_reply(2, 10)) is False
        finally:
            client.close()
            server.close()
    arun(scenario())
