"""CopyOnSend: a payload sent straight from the caller's memory, the rest copied once the send
falls behind, on a real loopback TCP connection and a real event loop. What the peer reads is
the payload as it was when ``run()`` returned, whatever the caller writes afterwards."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import numpy as np
import pytest
import uvloop

from podium import codec, errors
from podium.transport import copyonsend
from podium.transport.copyonsend import CopyOnSend

pytestmark = pytest.mark.timeout(120)

HEAD = b"HEAD-of-the-frame"


@pytest.fixture
def loop():
    loop = uvloop.new_event_loop()  # the loop Podium's connections run on
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


@pytest.fixture
def link(loop):
    """(sender transport, a second descriptor of its socket, the receiving socket)."""
    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    listener.close()

    async def attach():
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, sender)
        return transport

    transport = asyncio.run_coroutine_threadsafe(attach(), loop).result(10)
    sock = socket.socket(fileno=os.dup(sender.fileno()))
    sock.setblocking(False)
    yield transport, sock, receiver
    sock.close()
    loop.call_soon_threadsafe(transport.close)
    receiver.close()


def _payload(nbytes: int) -> tuple[bytearray, bytes, CopyOnSend, list[memoryview]]:
    src = bytearray(np.resize(np.arange(251, dtype=np.uint8), nbytes).tobytes())  # not a multiple of a page
    target = codec.Encoded(b"", [memoryview(src)]).pooled_target()
    return src, bytes(src), target, [memoryview(HEAD), *target.buffers]


def _future(loop) -> asyncio.Future:
    """A future of ``loop`` (the connection's end, for CopyOnSend.send)."""
    async def make():
        return loop.create_future()

    return asyncio.run_coroutine_threadsafe(make(), loop).result(10)


def _read(sock: socket.socket, nbytes: int) -> bytes:
    out = bytearray(nbytes)
    view, got = memoryview(out), 0
    while got < nbytes:
        n = sock.recv_into(view[got:])
        assert n, "the connection closed early"
        got += n
    return bytes(out)


def _wait_for_bytes(sock: socket.socket, count: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if len(sock.recv(count, socket.MSG_PEEK | socket.MSG_DONTWAIT)) >= count:
                return
        except BlockingIOError:
            pass
        assert time.monotonic() < deadline, "nothing arrived"
        time.sleep(0.001)


def test_a_stalled_send_gets_the_rest_copied_and_the_peer_reads_the_old_bytes(loop, link):
    transport, sock, receiver = link
    nbytes = 64 << 20  # far more than the socket buffers hold while nobody reads
    src, expected, target, segments = _payload(nbytes)
    cos = CopyOnSend(loop, [memoryview(src)], target.buffers)
    sending = asyncio.run_coroutine_threadsafe(cos.send(sock, transport, segments, _future(loop)), loop)
    _wait_for_bytes(receiver, len(HEAD) + 1)  # the send is under way from the caller's memory
    cos.run()
    assert 0 < cos.sent_directly < nbytes
    src[:] = b"\xff" * nbytes  # the caller's next step writes its buffer
    assert _read(receiver, len(HEAD) + nbytes) == HEAD + expected
    sending.result(30)


def test_a_send_within_the_grace_period_copies_nothing(loop, link, monkeypatch):
    monkeypatch.setattr(copyonsend, "_GRACE_BYTES_PER_SECOND", 1 << 20)  # a grace of minutes
    transport, sock, receiver = link
    nbytes = 16 << 20
    src, expected, target, segments = _payload(nbytes)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(_read(receiver, len(HEAD) + nbytes)))
    reader.start()
    cos = CopyOnSend(loop, [memoryview(src)], target.buffers)
    sending = asyncio.run_coroutine_threadsafe(cos.send(sock, transport, segments, _future(loop)), loop)
    cos.run()
    assert cos.sent_directly == nbytes  # every byte left from the caller's memory
    src[:] = b"\xff" * nbytes
    reader.join(60)
    sending.result(30)
    assert received == [HEAD + expected]


def test_a_payload_never_sent_is_copied_whole(loop):
    nbytes = 8 << 20
    src, expected, target, _ = _payload(nbytes)
    cos = CopyOnSend(loop, [memoryview(src)], target.buffers)
    cos.run()
    assert cos.sent_directly == 0
    src[:] = b"\xff" * nbytes
    assert bytes(target.buffers[0]) == expected
    asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(cos.copied), 10), loop).result(10)
    cos.check()  # the copy is complete: a path that sends the copy may go on


def test_a_send_waiting_on_a_connection_that_ends_raises_and_the_copy_still_completes(loop, link):
    transport, sock, receiver = link
    nbytes = 64 << 20
    src, expected, target, segments = _payload(nbytes)
    cos = CopyOnSend(loop, [memoryview(src)], target.buffers)
    ended = _future(loop)
    sending = asyncio.run_coroutine_threadsafe(cos.send(sock, transport, segments, ended), loop)
    _wait_for_bytes(receiver, len(HEAD) + 1)
    cos.run()  # the peer reads nothing: the rest is copied
    assert cos.sent_directly < nbytes
    src[:] = b"\xff" * nbytes
    assert bytes(target.buffers[0][cos.sent_directly:]) == expected[cos.sent_directly:]
    loop.call_soon_threadsafe(ended.set_result, None)  # the connection ends (FrameWriter.end)
    with pytest.raises(errors.UnavailableError, match="ended while a payload was sent"):
        sending.result(30)


def test_several_buffers_with_padding_between_them_arrive_as_they_were(loop, link):
    transport, sock, receiver = link
    sizes = (24 << 20, 3, 40 << 20 | 5)  # odd sizes: the wire form pads between buffers
    sources = [bytearray(np.resize(np.arange(i, 251 + i, dtype=np.uint8), n).tobytes()) for i, n in enumerate(sizes)]
    encoded = codec.Encoded(b"skeleton", [memoryview(s) for s in sources])
    expected = b"".join(bytes(s) for s in encoded.to_segments())  # the wire form as it is now
    target = encoded.pooled_target()
    cos = CopyOnSend(loop, [memoryview(s) for s in sources], target.buffers)
    segments = target.to_segments()
    sending = asyncio.run_coroutine_threadsafe(cos.send(sock, transport, segments, _future(loop)), loop)
    first = next(i for i, seg in enumerate(segments) if seg is target.buffers[0])
    _wait_for_bytes(receiver, sum(seg.nbytes for seg in segments[:first]) + 1)  # a buffer byte is out
    cos.run()
    assert 0 < cos.sent_directly < sum(sizes)
    for source in sources:
        source[:] = b"\xff" * len(source)
    assert _read(receiver, len(expected)) == expected
    sending.result(30)
