"""The raw call socket (podium.transport.callsocket): used by default, same answers as the gRPC stream,
guarded by the token, robust to garbage, and off with PODIUM_RAW_CALLS=0.

A real worker host in-process on port 0 and real WorkerClients; payloads cross TCP (shm
off) so multi-chunk frames go over the raw socket too.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

import pytest
import torch

from podium import errors
from podium.transport import callsocket, framewriter
from podium.worker.caller.client import WorkerClient
from podium.worker.host.process import start_host
from tests.support.waiting import eventually_async

pytestmark = pytest.mark.timeout(120)


class Calc:
    """Hosted object: sync and async methods, one that raises, one that sleeps."""

    def add(self, a, b):
        return a + b

    async def aadd(self, a, b):
        return a + b

    def boom(self):
        raise ValueError("boom")

    def nap(self, seconds):
        import time

        self.napping = True  # the test reads it through host.runtime.hosted
        time.sleep(seconds)
        return seconds

    def kept(self):
        """A 64 MiB tensor this object keeps and changes later (weights, a buffer)."""
        if not hasattr(self, "_kept"):
            self._kept = torch.zeros(64 << 20, dtype=torch.uint8)
        return self._kept

    def bump(self):
        self._kept += 1


@contextlib.asynccontextmanager
async def host_and_client(token, *, raw: bool = True, monkeypatch=None, tls=None):
    host = await start_host("127.0.0.1", token=token, env={"RANK": "0", "WORLD_SIZE": "1"}, tls=tls)
    client = WorkerClient(host.address, token, tls=tls)
    try:
        if not raw:
            monkeypatch.setenv("PODIUM_RAW_CALLS", "0")
        await client.start()
        client.same_host = False  # TCP only: every byte crosses the socket under test
        await client.construct((Calc, (), {}))
        yield host, client
    finally:
        await client.close()
        await host.stop(grace=0.2)


async def exercise(client: WorkerClient) -> None:
    """The same calls on either path."""
    assert await client.call("add", (2, 3)) == 5
    assert await client.call("aadd", (2, 5)) == 7
    with pytest.raises(errors.RemoteError, match="boom"):
        await client.call("boom")
    big = torch.randint(0, 1 << 30, (3_000_000,), dtype=torch.int64)  # 24 MiB: several chunks
    out = await client.call("add", (big, 1))
    assert torch.equal(out, big + 1)
    # pipelined calls through submit (one frame each) answer in any order, all correct
    from podium.worker.caller.client import prepare

    futures = [client.submit("add", prepare(((i, i), {}))) for i in range(200)]
    assert await asyncio.gather(*futures) == [2 * i for i in range(200)]
    with pytest.raises(errors.DeadlineExceededError):
        await client.call("nap", (2.0,), timeout=0.2)
    assert await client.call("add", (1, 1)) == 2  # the stream survives a deadline


def test_raw_socket_is_used_and_correct(token, arun):
    async def scenario():
        async with host_and_client(token) as (host, client):
            assert client.transport == "socket"
            assert (await client.describe()).call_port == host.runtime.call_port > 0
            await exercise(client)
    arun(scenario())


def test_grpc_stream_when_raw_calls_are_off(token, arun, monkeypatch):
    async def scenario():
        async with host_and_client(token, raw=False, monkeypatch=monkeypatch) as (_, client):
            assert client.transport == "grpc"
            await exercise(client)
    arun(scenario())


def test_wrong_token_is_rejected(token, arun):
    async def scenario():
        host = await start_host("127.0.0.1", token=token, env={"RANK": "0", "WORLD_SIZE": "1"})
        try:
            with pytest.raises(errors.AuthenticationError):
                await callsocket.connect("127.0.0.1", host.runtime.call_port, "not-the-token",
                                      bytes, lambda frame: None, lambda exc: None, timeout=10)
        finally:
            await host.stop(grace=0.2)
    arun(scenario())


def test_silent_peer_is_dropped_after_the_handshake_deadline(token, arun, monkeypatch):
    monkeypatch.setattr(callsocket, "HANDSHAKE_SECONDS", 0.2)

    async def scenario():
        host = await start_host("127.0.0.1", token=token, env={"RANK": "0", "WORLD_SIZE": "1"})
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", host.runtime.call_port)
            assert await asyncio.wait_for(reader.read(10), 10) == b""  # closed by the worker
            writer.close()
        finally:
            await host.stop(grace=0.2)
    arun(scenario())


def test_stopping_the_host_ends_open_connections(token, arun):
    async def scenario():
        host = await start_host("127.0.0.1", token=token, env={"RANK": "0", "WORLD_SIZE": "1"})
        client = WorkerClient(host.address, token)
        try:
            await client.start()
            await client.construct((Calc, (), {}))
            await host.stop(grace=0.2)
            with pytest.raises(errors.UnavailableError):
                await asyncio.wait_for(client.call("add", (1, 2)), 10)
        finally:
            await client.close()
    arun(scenario())


def test_garbage_closes_only_that_connection(token, arun):
    async def scenario():
        async with host_and_client(token) as (host, client):
            port = host.runtime.call_port
            loop = asyncio.get_running_loop()

            def send(payload: bytes) -> bytes:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(payload)
                    sock.shutdown(socket.SHUT_WR)
                    return sock.recv(100)

            # not the protocol at all
            assert await loop.run_in_executor(None, send, b"GET / HTTP/1.1\r\n\r\n") == b""
            # right token, then a frame that announces 1 GiB, then one that does not parse
            hello = struct.pack("<4sBH", callsocket.MAGIC, callsocket.VERSION, len(token)) + token.encode()
            assert await loop.run_in_executor(None, send, hello + struct.pack("<I", 1 << 30)) == b"\x00"
            assert await loop.run_in_executor(None, send, hello + struct.pack("<I", 3) + b"\xff\xff\xff") == b"\x00"
            # the real client still works
            assert await client.call("add", (20, 22)) == 42
    arun(scenario())


def test_worker_gone_fails_pending_calls(token, arun):
    async def scenario():
        async with host_and_client(token) as (host, client):
            pending = asyncio.ensure_future(client.call("nap", (5.0,)))
            await eventually_async(lambda: getattr(host.runtime.hosted, "napping", False), "the nap to start")
            for conn in list(host.runtime.raw_connections):  # the worker side drops it
                conn.close()
            with pytest.raises(errors.UnavailableError):
                await asyncio.wait_for(pending, 10)
            with pytest.raises(errors.UnavailableError):
                await client.call("add", (1, 2))
    arun(scenario())



def test_large_payloads_under_tls_are_written_as_the_socket_drains_and_stay_in_order(token, arun, tmp_path,
                                                                                     monkeypatch):
    """Under TLS a bulk payload is written slice by slice as the socket drains, by a task,
    so the event loop stays free (written at once, 1 GiB blocked it for 15 s and the peer's
    liveness pings failed); frames written meanwhile wait behind it. Several 24 MiB calls
    and replies in flight at once, with small calls between them, all arrive bit exact and
    in order while the loop keeps running."""
    from tests.support.certs import make_tls

    tls = make_tls(str(tmp_path / "certs"))
    senders = []
    send_outbox = framewriter.FrameWriter._send_outbox

    def counted(self):
        senders.append(self)
        return send_outbox(self)

    monkeypatch.setattr(framewriter.FrameWriter, "_send_outbox", counted)

    async def scenario():
        async with host_and_client(token, tls=tls) as (host, client):
            assert client.transport == "socket"
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.005)
                    ticks += 1

            tick_task = asyncio.get_running_loop().create_task(ticker())
            bases = [torch.arange(6 << 20, dtype=torch.float32) * (i + 1) for i in range(3)]
            calls = []
            for i, base in enumerate(bases):
                calls.append(client.call("add", (base, 1.0)))
                calls.append(client.call("add", (i, 1)))
            results = await asyncio.gather(*calls)
            tick_task.cancel()
            for i, base in enumerate(bases):
                assert torch.equal(results[2 * i], base + 1.0)
                assert results[2 * i + 1] == i + 1
            assert ticks > 0
            assert client.stats["bulk_sent"] >= 3 and client.stats["bulk_received"] >= 3
            assert len(set(map(id, senders))) == 2  # both ends wrote their payloads that way

    arun(scenario())


async def kept_then_bumped(client: WorkerClient, steps: int = 3) -> None:
    """The reply of ``kept`` is the value at return, though the very next call (sent with
    it, run while that reply is still leaving) changes the tensor in place."""
    from podium.worker.caller.client import prepare

    empty = prepare(((), {}))
    for step in range(steps):
        first, second = client.submit("kept", empty), client.submit("bump", empty)
        reply = await asyncio.wait_for(first, 60)
        await asyncio.wait_for(second, 60)
        assert int(reply.min()) == step and int(reply.max()) == step, step


@pytest.mark.parametrize("use_tls", [False, True], ids=["tcp", "tls"])
def test_a_large_reply_is_sent_from_the_methods_memory_and_is_still_the_value_at_return(
        token, arun, tmp_path, use_tls):
    """Over TCP a large reply made on the execution thread is not copied: it is sent from
    the tensor itself (``lent_out``), and the thread runs nothing else until the socket took
    it, so the next call's change cannot reach the reply. Plain TCP and TLS."""
    from tests.support.certs import make_tls

    tls = make_tls(str(tmp_path / "certs")) if use_tls else None

    async def scenario():
        async with host_and_client(token, tls=tls) as (host, client):
            assert client.transport == "socket"
            await kept_then_bumped(client)
            assert host.runtime.stats["lent_out"] == 3

    arun(scenario())


def test_a_peer_that_stops_reading_a_lent_reply_loses_its_connection_and_frees_the_worker(
        token, arun, monkeypatch):
    """The execution thread waits for a lent reply to leave, but not for ever: past the
    deadline the connection is closed, its caller gets an error, and other callers are
    served again."""
    from podium.worker.host import results
    from podium.worker.caller.client import prepare

    monkeypatch.setattr(results, "LENT_SECONDS", 0.5)

    async def scenario():
        async with host_and_client(token) as (host, client):
            other = WorkerClient(host.address, token)
            try:
                await other.start()
                other.same_host = False
                client._conn.carrier._transport.pause_reading()  # reads nothing from now on
                stuck = client.submit("kept", prepare(((), {})))
                # Calls on two connections have no order between them: "add" is sent once
                # "kept" ran, and is served only once the stuck reply's connection was closed.
                for _ in range(3000):
                    if host.runtime.stats["lent_out"] == 1:
                        break
                    await asyncio.sleep(0.01)
                assert host.runtime.stats["lent_out"] == 1
                assert await asyncio.wait_for(other.call("add", (1, 2)), 30) == 3
                client._conn.carrier._transport.resume_reading()
                with pytest.raises(errors.PodiumError):
                    await asyncio.wait_for(stuck, 30)
                assert await asyncio.wait_for(other.call("add", (2, 2)), 30) == 4
            finally:
                await other.close()
    arun(scenario())
