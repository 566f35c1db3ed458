"""The execution thread reading a raw call socket itself (podium.worker.host.directcalls).

While a call stream has nothing in hand, its loop lends the socket's read side to the
execution thread, which runs fast calls as it reads them and replies itself; every other
frame goes back to the loop, in order. These tests check that calls are answered that way
and counted, that frames the thread cannot take (bulk payloads, async methods, errors,
large replies, cancels of calls it does not hold) keep their order and meaning, that a
CANCEL still drops a call waiting behind a running one, and that the connection's end is
seen promptly both ways (the thread's descriptor must not keep the socket open).

A real worker host in-process, real WorkerClients and plain sockets on loopback TCP.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time

import pytest

from podium import codec, errors
from podium.transport import callsocket
from podium.v1 import worker_pb2
from podium.worker.caller.client import WorkerClient, prepare
from podium.worker.host.process import start_host

pytestmark = pytest.mark.timeout(120)


class Journal:
    """Hosted object that records the order its methods ran in."""

    def __init__(self):
        self.log = []
        self.napping = False  # the test reads it through host.runtime.hosted

    def note(self, x):
        self.log.append(x)
        return len(self.log)

    async def anote(self, x):
        self.log.append(x)
        return len(self.log)

    def big(self, x, nbytes):
        self.log.append(x)
        return b"b" * nbytes

    def boom(self, x):
        self.log.append(x)
        raise ValueError(f"boom {x}")

    def nap(self, seconds):
        self.napping = True
        time.sleep(seconds)
        self.napping = False

    def journal(self):
        return list(self.log)

    def hold(self, gate_path):
        """Wait (at most 30 s) for the test to create ``gate_path``."""
        self.log.append("hold")
        deadline = time.monotonic() + 30
        while not os.path.exists(gate_path) and time.monotonic() < deadline:
            time.sleep(0.005)
        return os.path.exists(gate_path)


async def _host_and_client(token):
    host = await start_host("127.0.0.1", token=token, env={"RANK": "0", "WORLD_SIZE": "1"})
    client = WorkerClient(host.address, token)
    await client.start()
    client.same_host = False  # no shared memory: the path a worker on another host takes
    await client.construct((Journal, (), {}))
    return host, client


async def _until(predicate, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _frame(call_id: int, method: str, args: tuple = (), kind: int = worker_pb2.CALL) -> bytes:
    data = b"".join(prepare((args, {})).segments()) if kind == worker_pb2.CALL else b""
    frame = worker_pb2.CallFrame(call_id=call_id, data=data, last=True, header=worker_pb2.CallHeader(
        kind=kind, method=method, payload_size=len(data))).SerializeToString()
    return struct.pack("<I", len(frame)) + frame


def _replies(received: bytes) -> dict[int, worker_pb2.ReplyFrame]:
    replies, at = {}, 0
    while at < len(received):
        (length,) = struct.unpack_from("<I", received, at)
        reply = worker_pb2.ReplyFrame.FromString(received[at + 4:at + 4 + length])
        replies[reply.call_id] = reply
        at += 4 + length
    return replies


def _raw_connection(token: str, port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(struct.pack("<4sBH", callsocket.MAGIC, callsocket.VERSION, len(token)) + token.encode())
    assert sock.recv(1) == b"\x00"
    return sock


def _lent_raw_connection(token: str, host) -> socket.socket:
    """A raw connection whose socket the host has lent to its execution thread: one call
    answered, then the loan seen (call from a thread other than the host's loop)."""
    sock = _raw_connection(token, host.runtime.call_port)
    sock.sendall(_frame(1, "note", ("warm",)))
    assert _recv_replies(sock, 1)[1].header.ok
    deadline = time.monotonic() + 30
    while not host.runtime.exec_thread.has_reader:
        assert time.monotonic() < deadline, "the socket was never lent"
        time.sleep(0.01)
    return sock


def _recv_replies(sock: socket.socket, count: int) -> dict[int, worker_pb2.ReplyFrame]:
    received = b""
    while True:
        replies = _replies(received) if received else {}
        if len(replies) >= count:
            return replies
        chunk = sock.recv(1 << 16)
        assert chunk, "the worker closed the connection"
        received += chunk


def test_fast_calls_are_read_run_and_answered_by_the_execution_thread(token, arun):
    async def scenario():
        host, client = await _host_and_client(token)
        try:
            for i in range(200):
                assert await client.call("note", (i,)) == i + 1
            stats = (await client.describe()).stats
            # The loop takes the first call after the constructor; the thread reads the rest.
            assert stats["direct_calls"] >= 190
            assert stats["calls"] == 200 and stats["calls_in_flight"] == 0 and stats["call_errors"] == 0
            assert stats["thread_replies"] >= stats["direct_calls"]
            assert stats["bytes_in"] > 0 and stats["bytes_out"] > 0
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())


def test_held_results_are_answered_as_refs_by_the_execution_thread(token, arun):
    """``blocking=False`` calls hold their results in the worker and answer with refs: a burst
    of them is answered from the execution thread too (no wake-up of the loop per call), each
    ref naming the value the worker holds and carrying it inline."""
    async def scenario():
        host, client = await _host_and_client(token)
        try:
            assert await client.call("note", ("warm",)) == 1
            await _until(lambda: host.runtime.exec_thread.has_reader, "the socket's loan")
            before = dict(host.runtime.stats_now())
            refs = await asyncio.gather(*[client.submit("note", prepare(((i,), {})), hold=True)
                                          for i in range(50)])
            stats = host.runtime.stats_now()
            assert stats["thread_replies"] - before["thread_replies"] >= 45
            for i, ref in enumerate(refs):
                assert host.runtime.held.get(ref.object_id).value == i + 2
                assert codec.decode(ref.inline) == i + 2 and ref.owner_address == host.address
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())


def test_frames_the_thread_cannot_take_go_to_the_loop_in_order(token, arun):
    """A pipelined burst mixing fast calls with a bulk argument, an async method, an error
    and a bulk reply: every call answers correctly, sync calls ran in the order sent, and
    the socket went back to the thread after each detour."""
    async def scenario():
        host, client = await _host_and_client(token)
        try:
            futures, expected = [], []
            for i in range(60):
                kind = i % 6
                if kind == 1:  # a 256 KiB argument: a bulk frame, read by the loop
                    futures.append(client.submit("note", prepare(((b"a" * (256 << 10),), {}))))
                    expected.append("bulk-arg")
                elif kind == 3:
                    futures.append(client.submit("boom", prepare(((i,), {}))))
                    expected.append(i)
                elif kind == 5:  # a 1 MiB reply: lent by the thread, written by the loop
                    futures.append(client.submit("big", prepare(((i, 1 << 20), {}))))
                    expected.append(i)
                else:
                    futures.append(client.submit("note", prepare(((i,), {}))))
                    expected.append(i)
            done = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 60)
            for i, outcome in enumerate(done):
                if i % 6 == 3:
                    assert isinstance(outcome, errors.PodiumError) and f"boom {i}" in str(outcome)
                elif i % 6 == 5:
                    assert outcome == b"b" * (1 << 20)
                else:
                    assert outcome == i + 1  # the journal's length: each call ran in its turn
            journal = await client.call("journal")
            assert ["bulk-arg" if type(x) is bytes else x for x in journal] == expected
            # An async method runs on the loop: the thread hands its frame over, and the
            # socket is lent again once the stream is idle.
            assert await client.call("anote", ("async",)) == 61
            before = (await client.describe()).stats["direct_calls"]
            for i in range(20):
                assert await client.call("note", ("after",)) == 62 + i
            stats = (await client.describe()).stats
            assert stats["direct_calls"] >= before + 15
            assert stats["bulk_in"] == 10
            assert stats["call_errors"] == 10 and stats["calls_in_flight"] == 0
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())


def test_a_burst_of_quick_calls_is_answered_in_full_and_no_reply_waits_for_a_slow_call(token, arun, tmp_path):
    """Calls read together whose method ran quickly before have their replies sent together;
    a reply never waits for a call that may be slow: the replies of the calls before ``hold``
    arrive while ``hold`` still blocks (it waits for a file the test writes once they did)."""
    async def scenario():
        host, _client = await _host_and_client(token)
        gate = str(tmp_path / "gate")
        try:
            sock = await asyncio.to_thread(_lent_raw_connection, token, host)
            try:
                burst = b"".join(_frame(i, "note", (i,)) for i in range(2, 52))
                await asyncio.to_thread(sock.sendall, burst)
                replies = await asyncio.to_thread(_recv_replies, sock, 50)
                assert sorted(replies) == list(range(2, 52))
                assert all(r.header.ok for r in replies.values())
                # Two quick calls, then one that blocks until their replies are here.
                await asyncio.to_thread(sock.sendall, _frame(60, "note", ("a",)) + _frame(61, "note", ("b",))
                                        + _frame(62, "hold", (gate,)))
                early = await asyncio.to_thread(_recv_replies, sock, 2)
                assert sorted(early) == [60, 61]
                open(gate, "w").close()
                late = await asyncio.to_thread(_recv_replies, sock, 1)
                assert list(late) == [62] and codec.decode(late[62].data) is True
            finally:
                sock.close()
            stats = host.runtime.stats_now()
            assert stats["calls_in_flight"] == 0 and stats["thread_replies"] >= 50
        finally:
            await host.stop(grace=0.2)
    arun(scenario())


def test_a_cancel_drops_a_call_waiting_behind_the_one_running(token, arun):
    """Calls that arrive while the thread runs a long call wait in the socket; the CANCEL
    sent meanwhile (the call's deadline passed) is read before any of them runs."""
    async def scenario():
        host, client = await _host_and_client(token)
        try:
            assert await client.call("note", ("first",)) == 1
            await _until(lambda: host.runtime.exec_thread.has_reader, "the socket to be lent")
            before = host.runtime.stats_now()["direct_calls"]
            blocker = client.submit("nap", prepare(((1.0,), {})), timeout=60)
            await asyncio.sleep(0.2)  # the nap holds the execution thread
            kept = client.submit("note", prepare((("kept",), {})), timeout=60)
            with pytest.raises(errors.DeadlineExceededError):
                await client.submit("note", prepare((("dropped",), {})), timeout=0.2)
            await asyncio.wait_for(blocker, 30)
            assert await asyncio.wait_for(kept, 30) == 2
            assert await client.call("journal") == ["first", "kept"]
            stats = host.runtime.stats_now()
            assert stats["direct_calls"] >= before + 2  # the nap and "kept" went the thread's way
            assert stats["call_errors"] == 1  # the cancelled call: answered, never run
            # A CANCEL of a call that is running (or ran) is not the thread's: it goes to the
            # loop, which ignores it, and the socket is lent again.
            with pytest.raises(errors.DeadlineExceededError):
                await client.submit("nap", prepare(((0.5,), {})), timeout=0.1)
            await _until(lambda: not host.runtime.hosted.napping and host.runtime.exec_thread.has_reader,
                         "the nap to end and the socket to be lent again")
            before = host.runtime.stats_now()["direct_calls"]
            assert await client.call("note", ("last",)) == 3
            assert await client.call("note", ("last",)) == 4
            assert host.runtime.stats_now()["direct_calls"] >= before + 1
        finally:
            await client.close()
            await host.stop(grace=0.2)
    arun(scenario())


def test_a_raw_client_that_half_closes_gets_every_answer(token, arun):
    async def scenario():
        host, client = await _host_and_client(token)
        try:
            await client.close()  # its stream ends: the socket it had lent goes back

            def talk() -> dict[int, worker_pb2.ReplyFrame]:
                with _lent_raw_connection(token, host) as sock:
                    sock.sendall(b"".join(_frame(i, "note", (i,)) for i in range(2, 202)))
                    sock.shutdown(socket.SHUT_WR)
                    received = b""
                    while chunk := sock.recv(1 << 16):
                        received += chunk
                return _replies(received)

            replies = await asyncio.to_thread(talk)
            assert sorted(replies) == list(range(2, 202))
            assert [codec.decode(replies[i].data) for i in range(2, 202)] == list(range(2, 202))
            assert host.runtime.stats_now()["direct_calls"] >= 200  # the calls held at EOF too
        finally:
            await host.stop(grace=0.2)
    arun(scenario())


def test_garbage_on_a_lent_socket_closes_that_connection_only(token, arun):
    async def scenario():
        host, client = await _host_and_client(token)
        try:
            await client.close()

            def garbage() -> bytes:
                with _lent_raw_connection(token, host) as sock:
                    sock.sendall(struct.pack("<I", 7) + b"\xff" * 7)  # not a CallFrame
                    return sock.recv(1 << 16)

            assert await asyncio.to_thread(garbage) == b""  # closed by the worker
            other = WorkerClient(host.address, token)
            await other.start()
            try:
                assert await other.call("note", ("still",)) == 2
            finally:
                await other.close()
        finally:
            await host.stop(grace=0.2)
    arun(scenario())


def test_stopping_the_host_closes_a_lent_socket(token, arun):
    """The thread's own descriptor of the socket must not keep it open once the host
    closes the connection: the client sees the end at once."""
    async def scenario():
        host, client = await _host_and_client(token)
        stopped = False
        try:
            assert await client.call("note", (1,)) == 1
            await _until(lambda: host.runtime.exec_thread.has_reader, "the socket to be lent")
            pending = client.submit("nap", prepare(((0.3,), {})))
            await _until(lambda: host.runtime.hosted.napping, "the nap to start")
            await host.stop(grace=0.2)
            stopped = True
            with pytest.raises(errors.PodiumError):
                await asyncio.wait_for(client.call("note", (2,)), 10)
            await asyncio.wait_for(asyncio.gather(pending, return_exceptions=True), 10)
        finally:
            await client.close()
            if not stopped:
                await host.stop(grace=0.2)
    arun(scenario())
