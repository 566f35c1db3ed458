"""The fast path of a worker's call stream: CallFrame/ReplyFrame messages on a plain TCP socket.

Measured on the 2-core machines Podium targets, a message each way on a grpc.aio
bidirectional stream costs about 0.28 ms (every write and read is a round through
gRPC's completion queue and poller thread); the same protobuf messages framed on an
asyncio socket cost a fraction of that. So besides its gRPC server a worker listens on
a second port (``DescribeResponse.call_port``, same address) that speaks exactly the
``Calls`` stream's messages, and clients use it when they can.

Wire form::

    client -> server   b"PDMC" u8 version(1) u16 token length, token (UTF-8)
    server -> client   u8 status: 0 accepted, 1 token rejected (then the server closes)
    then, both ways    u32 length (little-endian), that many bytes of one serialized
                       message: CallFrame client -> server, ReplyFrame server -> client

Security is the gRPC port's: the cluster token is checked (in constant time) before any
frame is read, and a worker opens this port only where it serves without TLS (with TLS
every call takes the gRPC stream). A frame larger than :data:`MAX_FRAME_BYTES` or one
that does not parse ends the connection.

:class:`FrameConnection` is an ``asyncio.Protocol`` used by both sides: the server hands
each accepted connection to the worker host's ``CallStream`` as its ``context``
(``await read()`` / ``await write(frame)``, EOF is ``grpc.aio.EOF``), the client takes
frames through a callback as they arrive (no reader task, no queue).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import struct
from typing import Any, Callable

import grpc

from podium import errors
from podium.transport.chunks import CHUNK_SIZE

__all__ = ["MAGIC", "VERSION", "MAX_FRAME_BYTES", "FrameConnection", "serve", "connect"]

log = logging.getLogger("podium.transport.callsocket")

MAGIC = b"PDMC"
VERSION = 1
#: Largest serialized frame accepted: one payload chunk plus room for the header.
MAX_FRAME_BYTES = CHUNK_SIZE + (1 << 20)

_LEN = struct.Struct("<I")
_HELLO = struct.Struct("<4sBH")
_ACCEPTED, _REJECTED = b"\x00", b"\x01"
# Frames smaller than this wait for the end of the loop turn to leave together,
# at most this many at a time.
_COALESCE_MAX = 65536
_COALESCE_FRAMES = 16
# Stop reading from the socket while this many parsed frames wait for the server side.
_MAX_QUEUED_FRAMES = 64
#: A connection that has not completed its handshake by then is closed (server side).
HANDSHAKE_SECONDS = 10.0


class FrameConnection(asyncio.Protocol):
    """One side of a raw call connection (see the module docstring).

    ``parse`` turns bytes into the incoming message type. With ``on_frame`` every
    incoming frame is handed to it at once (client); without, frames queue for
    :meth:`read` (server). ``on_lost(exc)`` runs once when the connection ends.
    """

    def __init__(self, parse: Callable[[bytes], Any], *, token: str | None = None, server: bool,
                 on_frame: Callable[[Any], None] | None = None,
                 on_ready: Callable[["FrameConnection"], None] | None = None,
                 on_lost: Callable[[BaseException | None], None] | None = None) -> None:
        self._parse = parse
        self._token = token
        self._server = server
        self._on_frame = on_frame
        self._on_ready = on_ready
        self._on_lost = on_lost
        self._buffer = bytearray()
        self._handshaken = False
        # Set by connection_made, before any other method can run.
        self._transport: Any = None
        self._frames: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._drained: asyncio.Future | None = None
        self._paused_writing = False
        self._paused_reading = False
        self._pending: list[bytes] = []
        self._flush_scheduled = False
        self._closed = False
        self.lost_error: BaseException | None = None
        #: Resolves when the handshake is done (True) or failed (exception).
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        if self._server:  # a peer that never says hello must not hold a socket forever
            asyncio.get_running_loop().call_later(HANDSHAKE_SECONDS, self._handshake_deadline)
        else:
            token = (self._token or "").encode()
            transport.write(_HELLO.pack(MAGIC, VERSION, len(token)) + token)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        if not self._handshaken and not self._handshake():
            return
        pos, size = 0, len(buffer)
        try:
            while size - pos >= 4:
                (length,) = _LEN.unpack_from(buffer, pos)
                if length > MAX_FRAME_BYTES:
                    raise errors.DataLossError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
                end = pos + 4 + length
                if end > size:
                    break
                frame = self._parse(bytes(buffer[pos + 4:end]))
                pos = end
                if self._on_frame is not None:
                    self._on_frame(frame)
                else:
                    self._frames.append(frame)
        except Exception as exc:  # noqa: BLE001 - garbage from the peer ends the connection
            log.warning("raw call connection: %s: %s; closing it", type(exc).__name__, exc)
            self._abort(exc)
            return
        if pos:
            del buffer[:pos]
        if self._on_frame is None and self._frames:
            self._wake()
            if len(self._frames) >= _MAX_QUEUED_FRAMES and not self._paused_reading:
                self._paused_reading = True
                self._transport.pause_reading()

    def _handshake_deadline(self) -> None:
        if not self._handshaken and not self._closed:
            self._abort(errors.DeadlineExceededError("raw call connection: no handshake in time"))

    def _handshake(self) -> bool:
        buffer = self._buffer
        if self._server:
            if len(buffer) < _HELLO.size:
                return False
            magic, version, length = _HELLO.unpack_from(buffer, 0)
            if magic != MAGIC or version != VERSION:
                self._abort(errors.InvalidArgumentError("not a Podium raw call connection"))
                return False
            if len(buffer) < _HELLO.size + length:
                return False
            offered = bytes(buffer[_HELLO.size:_HELLO.size + length])
            del buffer[:_HELLO.size + length]
            if not hmac.compare_digest(offered, (self._token or "").encode()):
                self._transport.write(_REJECTED)
                self._abort(errors.AuthenticationError("raw call connection with a wrong token"))
                return False
            self._transport.write(_ACCEPTED)
        else:
            if not buffer:
                return False
            status = bytes(buffer[:1])
            del buffer[:1]
            if status != _ACCEPTED:
                exc = errors.AuthenticationError("the worker rejected the cluster token")
                if not self.ready.done():
                    self.ready.set_exception(exc)
                self._abort(exc)
                return False
        self._handshaken = True
        if not self.ready.done():
            self.ready.set_result(True)
        if self._on_ready is not None:
            self._on_ready(self)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self.lost_error is None:
            self.lost_error = exc
        if not self.ready.done():
            self.ready.set_exception(errors.UnavailableError(
                f"raw call connection closed during the handshake: {exc or 'EOF'}"))
            self.ready.exception()  # retrieved by whoever awaits; never "never retrieved"
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if self._on_lost is not None:
            on_lost, self._on_lost = self._on_lost, None
            on_lost(self.lost_error)

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # ---------------------------------------------------------------- use

    @property
    def closed(self) -> bool:
        """True once the connection has ended."""
        return self._closed

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _abort(self, exc: BaseException) -> None:
        self.lost_error = exc
        if self._transport is not None:
            self._transport.close()

    def write_nowait(self, message: Any) -> None:
        """Queue ``message`` on the socket (never blocks; see :meth:`drain`).

        Small frames written in one loop turn leave in one send (a burst of calls or
        replies costs one system call and one wake-up of the peer, not one per frame).
        """
        self.write_serialized_nowait(message.SerializeToString())

    def write_serialized_nowait(self, data: bytes) -> None:
        """:meth:`write_nowait` of a message already serialized to ``data``."""
        if self._closed:
            raise errors.UnavailableError("the raw call connection is closed")
        if len(data) >= _COALESCE_MAX:
            self._flush()
            self._transport.write(_LEN.pack(len(data)))
            self._transport.write(data)
            return
        self._pending.append(_LEN.pack(len(data)) + data)
        if len(self._pending) >= _COALESCE_FRAMES:
            self._flush()  # a long burst: let the peer start on the first frames meanwhile
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending = self._pending
        if not pending or self._closed:
            pending.clear()
            return
        self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))
        pending.clear()

    @property
    def must_drain(self) -> bool:
        """True while the socket's send buffer is above its high-water mark."""
        return self._paused_writing and not self._closed

    async def drain(self) -> None:
        """Wait until the send buffer is below its high-water mark (or the connection ended)."""
        while self._paused_writing and not self._closed:
            if self._drained is None or self._drained.done():
                self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    async def write(self, message: Any) -> None:
        """Send ``message``, waiting for room when the peer reads slowly (server ``context``)."""
        self.write_nowait(message)
        if self._paused_writing:
            await self.drain()

    async def read(self) -> Any:
        """The next incoming frame, or ``grpc.aio.EOF`` once the connection ended (server ``context``)."""
        while not self._frames:
            if self._closed:
                return grpc.aio.EOF
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        frame = self._frames.popleft()
        if self._paused_reading and len(self._frames) < _MAX_QUEUED_FRAMES // 2:
            self._paused_reading = False
            self._transport.resume_reading()
        return frame

    def close(self) -> None:
        """Close the socket (buffered frames are still sent)."""
        if self._transport is not None and not self._closed:
            self._flush()
            self._transport.close()


async def serve(address: str, token: str, parse: Callable[[bytes], Any],
                on_connection: Callable[[FrameConnection], None]) -> tuple[asyncio.AbstractServer, int]:
    """Listen on ``address:0``; each authenticated connection goes to ``on_connection``.

    Returns the server and its port.
    """
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: FrameConnection(parse, token=token, server=True, on_ready=on_connection),
        host=address.strip("[]"), port=0)
    port = server.sockets[0].getsockname()[1]
    return server, port


async def connect(host: str, port: int, token: str, parse: Callable[[bytes], Any],
                  on_frame: Callable[[Any], None], on_lost: Callable[[BaseException | None], None],
                  timeout: float | None = 30.0) -> FrameConnection:
    """Open and authenticate a client connection; frames go to ``on_frame`` as they arrive."""
    loop = asyncio.get_running_loop()

    async def go() -> FrameConnection:
        _, conn = await loop.create_connection(
            lambda: FrameConnection(parse, token=token, server=False, on_frame=on_frame, on_lost=on_lost),
            host=host.strip("[]"), port=port)
        try:
            await conn.ready
        except BaseException:
            conn.close()
            raise
        return conn

    return await asyncio.wait_for(go(), timeout)
