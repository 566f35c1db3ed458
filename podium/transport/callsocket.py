"""The fast path of a worker's call stream: CallFrame/ReplyFrame messages on a plain TCP socket.

Measured on the 2-core machines Podium targets, a message each way on a grpc.aio
bidirectional stream costs about 0.28 ms (every write and read is a round through
gRPC's completion queue and poller thread); the same protobuf messages framed on an
asyncio socket cost a fraction of that. So besides its gRPC server a worker listens on
a second port (``DescribeResponse.call_port``, same address) that speaks exactly the
``Calls`` stream's messages, and clients use it when they can.

Wire form::

    client -> server   b"PDMC" u8 version (2) u16 token length, token (UTF-8)
    server -> client   u8 status: 0 accepted, 1 token rejected (then the server closes)
    then, both ways    u32 length (little-endian), that many bytes of one serialized
                       message: CallFrame client -> server, ReplyFrame server -> client;
                       or, for a whole payload at once (a *bulk* frame), the length with
                       its top bit set, u64 payload size, the message (its ``data``
                       empty), then the payload's bytes as they are

A bulk frame moves a large payload without protobuf around it: the sender writes the
tensors' own memory (no chunk copies, no serialization of the data), and the receiver
reads the bytes straight from the socket into their final buffer (this class is an
``asyncio.BufferedProtocol``: the event loop calls ``recv_into`` on memory it hands out),
taken from the process's reused mappings (:mod:`podium.memorypool`). A bulk
larger than the receiver's limit is refused before any memory is taken: its bytes are
read into a small scratch buffer and dropped, and the frame arrives with the error
(:class:`BulkFrame`), so the call fails and the connection carries on.

Security is the gRPC port's: the cluster token is checked (in constant time) before any
frame is read, and where the cluster uses TLS this port speaks mutual TLS with the same
certificates (the peer's certificate must be signed by the cluster CA, before the token is
even read). A frame larger than :data:`MAX_FRAME_BYTES` or one that does not parse ends
the connection.

:class:`FrameConnection` is an ``asyncio.BufferedProtocol`` used by both sides: the server hands
each accepted connection to the worker host's ``CallStream`` as its ``context``
(``await read()`` / ``await write(frame)``, EOF is ``grpc.aio.EOF``), the client takes
frames through a callback as they arrive (no reader task, no queue). It reads and parses
frames itself and is composed of two parts with their own state: its sending side
(:class:`~podium.transport.framewriter.FrameWriter`) and what another thread may borrow of it
(:class:`~podium.transport.threadloan.ThreadLoan`); bulk payloads arrive as
:mod:`podium.transport.bulkframes`.
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
from podium.memorypool import POOL
from podium.transport.bulkframes import BulkFrame, IncomingBulk
from podium.transport.chunks import CHUNK_SIZE
from podium.transport.frames import BULK_FLAG, FRAME_LENGTH
from podium.transport.framewriter import FrameWriter
from podium.transport.preauth import HANDSHAKE_SECONDS, MAX_TOKEN_BYTES, PreAuthGate
from podium.transport.threadloan import ThreadLoan

__all__ = ["MAGIC", "VERSION", "MAX_FRAME_BYTES", "BULK_MIN_BYTES", "HANDSHAKE_SECONDS", "BulkFrame",
           "FrameConnection", "serve", "connect", "hello"]

log = logging.getLogger("podium.transport.callsocket")

MAGIC = b"PDMC"
VERSION = 2
#: Largest serialized frame accepted: one payload chunk plus room for the header.
MAX_FRAME_BYTES = CHUNK_SIZE + (1 << 20)
#: Payloads at least this large go as one bulk frame (smaller ones inside their message:
#: one write of a few kilobytes beats a second section).
BULK_MIN_BYTES = 64 << 10

_LEN = FRAME_LENGTH
_BULK = struct.Struct("<IQ")
_BULK_FLAG = BULK_FLAG
# The read buffer of frames (bulk bytes bypass it): this much at first, grown to fit a frame.
_READ_BUFFER = 256 << 10
# The send buffer's high-water mark (asyncio's default); the low one is 0 (connection_made).
_HIGH_WATER = 64 << 10
_HELLO = struct.Struct("<4sBH")
_ACCEPTED, _REJECTED = b"\x00", b"\x01"
# Stop reading from the socket while this many parsed frames wait for the server side.
_MAX_QUEUED_FRAMES = 64
# Before the token is checked a server-side connection reads into this much, the longest
# hello, and nothing more (podium.transport.preauth); the frame buffer comes after.
_HELLO_BUFFER = _HELLO.size + MAX_TOKEN_BYTES


def hello(token: str) -> bytes:
    """The first bytes a client sends on a raw call socket: magic, version and ``token``."""
    raw = token.encode()
    return _HELLO.pack(MAGIC, VERSION, len(raw)) + raw


class FrameConnection(asyncio.BufferedProtocol):
    """One side of a raw call connection (see the module docstring).

    ``parse`` turns bytes into the incoming message type. With ``on_frame`` every
    incoming frame (or :class:`BulkFrame`) is handed to it at once (client); without,
    frames queue for :meth:`read` (server). ``on_lost(exc)`` runs once when the
    connection ends. ``max_bulk`` is the largest bulk payload this side accepts. A server-side
    connection waits for its hello in ``gate`` (:class:`~podium.transport.preauth.PreAuthGate`).
    """

    def __init__(self, parse: Callable[[bytes], Any], *, token: str | None = None, server: bool,
                 on_frame: Callable[[Any], None] | None = None,
                 on_ready: Callable[["FrameConnection"], None] | None = None,
                 on_lost: Callable[[BaseException | None], None] | None = None,
                 max_bulk: int = 0, gate: PreAuthGate | None = None) -> None:
        self._parse = parse
        self._token = token
        self._server = server
        self._on_frame = on_frame
        self._on_ready = on_ready
        self._on_lost = on_lost
        self._max_bulk = max_bulk
        self._gate = gate
        # Frames are read into _buffer[_start:_end]; never resized in place (the event loop
        # may still hold a view of it), replaced by a larger one when a frame needs it. A
        # server reads the hello into a small one first (nothing large before the token).
        self._buffer = bytearray(_HELLO_BUFFER if server else _READ_BUFFER)
        self._start = self._end = 0
        self._bulk: IncomingBulk | None = None
        self._filled = False  # a bulk payload was received (into mappings tagged with self)
        self._encrypted = False
        self._handshaken = False
        # Set by connection_made, before any other method can run.
        self._transport: Any = None
        self._frames: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        #: Server side: ``on_idle()`` runs when the reader is about to wait with nothing
        #: queued, the moment :meth:`ThreadLoan.lend_reads` can be offered.
        self.on_idle: Callable[[], None] | None = None
        self._paused_reading = False
        self._closed = False
        self._eof = False  # the peer closed its side (server)
        self.lost_error: BaseException | None = None
        loop = asyncio.get_running_loop()
        #: What another thread may borrow of this connection: its read side and small
        #: writes (server side, plain TCP; podium.transport.threadloan).
        self.loan = ThreadLoan(self, loop)
        #: The sending side (podium.transport.framewriter); its methods are this connection's.
        self.writer = writer = FrameWriter(self.loan, self._abort)
        self.write_nowait = writer.write_nowait
        self.write_serialized_nowait = writer.write_serialized_nowait
        self.write_bulk = writer.write_bulk
        self.drain = writer.drain
        self.write = writer.write
        #: True while something written on the loop has not left this process (or the
        #: connection ends): a thread's write must not pass it (ThreadLoan.write_from_thread).
        self.holds_output = writer.holds_output
        #: Resolves when the handshake is done (True) or failed (exception).
        self.ready: asyncio.Future = loop.create_future()

    def peer_uid(self) -> int | None:
        """The local user at the other end (:func:`podium.transport.peeruid.peer_uid`)."""
        from podium.transport.peeruid import peer_uid

        sock = self._transport.get_extra_info("socket") if self._transport is not None else None
        return peer_uid(sock) if sock is not None else None

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._encrypted = transport.get_extra_info("sslcontext") is not None
        self.writer.attach(transport, self._encrypted)
        if not self._encrypted:
            # resume_writing then means "nothing left in this process" (see write_bulk's on_sent).
            transport.set_write_buffer_limits(high=_HIGH_WATER, low=0)  # type: ignore[attr-defined]
        if self._server:  # a peer that never says hello must not hold a socket forever
            asyncio.get_running_loop().call_later(HANDSHAKE_SECONDS, self._handshake_deadline)
            if self._gate is not None:
                peer = transport.get_extra_info("peername")
                self._gate.admit(self, str(peer[0]) if peer else "")
        else:
            transport.write(hello(self._token or ""))  # type: ignore[attr-defined]

    def get_buffer(self, sizehint: int) -> memoryview:
        bulk = self._bulk
        if bulk is not None:
            return bulk.target()
        buffer = self._buffer
        if not self._handshaken and self._server:  # the hello fits, or is refused before
            return memoryview(buffer)[self._end:]
        if len(buffer) - self._end < 65536:
            pending = self._end - self._start
            need = pending + 65536
            if self._handshaken and pending >= 4:  # room for the whole frame now arriving
                length = _LEN.unpack_from(buffer, self._start)[0] & ~_BULK_FLAG
                if length <= MAX_FRAME_BYTES:  # a larger one is refused once parsed
                    need = max(need, _BULK.size + length)
            if need > len(buffer):
                grown = bytearray(max(need, 2 * len(buffer)))
                grown[:pending] = buffer[self._start:self._end]
                self._buffer = buffer = grown
            else:
                buffer[:pending] = buffer[self._start:self._end]
            self._start, self._end = 0, pending
        return memoryview(buffer)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        bulk = self._bulk
        if bulk is not None:
            bulk.add(nbytes)
            if bulk.received < bulk.size:
                return
            self._bulk = None
            self._deliver(bulk.finish())
        else:
            self._end += nbytes
        if not self._handshaken and not self._handshake():
            return
        try:
            self._parse_frames()
        except Exception as exc:  # noqa: BLE001 - garbage from the peer ends the connection
            log.warning("raw call connection: %s: %s; closing it", type(exc).__name__, exc)
            self._abort(exc)
            return
        if self._on_frame is not None:
            return
        if self._frames:
            self._wake()
            if len(self._frames) >= _MAX_QUEUED_FRAMES and not self._paused_reading:
                self._paused_reading = True
                self._transport.pause_reading()

    def _parse_frames(self) -> None:
        buffer, pos, end = self._buffer, self._start, self._end
        while end - pos >= 4 and self._bulk is None:
            (length,) = _LEN.unpack_from(buffer, pos)
            if length & _BULK_FLAG:
                if end - pos < _BULK.size:
                    break
                length &= ~_BULK_FLAG
                (size,) = _BULK.unpack_from(buffer, pos)[1:]
                head = _BULK.size
            else:
                size, head = -1, 4
            if length > MAX_FRAME_BYTES:
                raise errors.DataLossError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
            if end - pos < head + length:
                break
            message = self._parse(bytes(buffer[pos + head:pos + head + length]))
            pos += head + length
            if size < 0:
                self._deliver(message)
                continue
            bulk = IncomingBulk(message, size, self._max_bulk, owner=self)
            self._filled = True
            take = min(size, end - pos)
            if take:
                bulk.fill(memoryview(buffer)[pos:pos + take])
                pos += take
            if bulk.received == size:
                self._deliver(bulk.finish())
            else:
                self._bulk = bulk  # the rest goes straight into its buffer
        self._start = pos
        if pos == end:
            self._start = self._end = 0

    def _deliver(self, frame: Any) -> None:
        if self._on_frame is not None:
            self._on_frame(frame)
            return
        self._frames.append(frame)

    def _handshake_deadline(self) -> None:
        if not self._handshaken and not self._closed:
            self._abort(errors.DeadlineExceededError("raw call connection: no handshake in time"))

    def _handshake(self) -> bool:
        buffer, start = self._buffer, self._start
        available = self._end - start
        if self._server:
            if available < _HELLO.size:
                return False
            magic, version, length = _HELLO.unpack_from(buffer, start)
            if magic != MAGIC or version != VERSION:
                self._abort(errors.InvalidArgumentError("not a Podium raw call connection (or another version)"))
                return False
            if length > MAX_TOKEN_BYTES:
                self._abort(errors.InvalidArgumentError(f"a token of {length} bytes is no Podium token"))
                return False
            if available < _HELLO.size + length:
                return False
            offered = bytes(buffer[start + _HELLO.size:start + _HELLO.size + length])
            self._start += _HELLO.size + length
            if not hmac.compare_digest(offered, (self._token or "").encode()):
                self._transport.write(_REJECTED)
                self._abort(errors.AuthenticationError("raw call connection with a wrong token"))
                return False
            self._transport.write(_ACCEPTED)
            self._authenticated()
        else:
            if not available:
                return False
            status = bytes(buffer[start:start + 1])
            self._start += 1
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

    def _authenticated(self) -> None:
        # Only now does the connection take its frame buffer and, on plain TCP, the second
        # descriptor another thread may read and write it through (ThreadLoan).
        if self._gate is not None:
            self._gate.leave(self)
        pending = self._end - self._start
        buffer = bytearray(_READ_BUFFER)
        buffer[:pending] = self._buffer[self._start:self._end]
        self._buffer, self._start, self._end = buffer, 0, pending
        sock = self._transport.get_extra_info("socket")
        if not self._encrypted and sock is not None:
            self.loan.attach(self._transport, sock)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._gate is not None:
            self._gate.leave(self)
        loan = self.loan
        loan.end()
        with loan.lock:
            self._closed = self.writer.closed = True
            loan.close_locked()
        if self._bulk is not None:  # cut mid-payload: its buffer goes back
            self._bulk.abandon()
            self._bulk = None
            if exc is None:
                exc = errors.DataLossError("the connection ended in the middle of a payload")
        if self._filled:  # what this peer filled does not stay resident after it leaves
            POOL.release_pages_of(self)
        if self.lost_error is None:
            self.lost_error = exc
        if not self.ready.done():
            self.ready.set_exception(errors.UnavailableError(
                f"raw call connection closed during the handshake: {exc or 'EOF'}"))
            self.ready.exception()  # retrieved by whoever awaits; never "never retrieved"
        self._wake()
        self.writer.end()  # nothing more will be read from lent memory
        if self._on_lost is not None:
            on_lost, self._on_lost = self._on_lost, None
            on_lost(self.lost_error)

    def eof_received(self) -> bool | None:
        # A client that sends its calls and then closes its side still gets every answer:
        # the server reads EOF and keeps writing (plain TCP; TLS cannot half-close). A
        # connection that ends inside a frame or a bulk payload is cut (DataLossError).
        if (not self._server or self._encrypted or not self._handshaken or self._bulk is not None
                or self._end > self._start):
            return None  # the transport closes; connection_lost follows
        self._eof = True
        self._wake()
        return True

    def pause_writing(self) -> None:
        self.writer.pause()

    def resume_writing(self) -> None:
        self.writer.resume()

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

    def abort(self, exc: BaseException) -> None:
        """End the connection now, dropping what is still queued; ``exc`` is why (on the loop)."""
        if self._transport is not None and not self._closed:
            self.lost_error = exc
            self._transport.abort()

    def holds_input(self) -> bool:
        """True while input is in hand here (bytes, frames, a bulk payload), the handshake is
        not done, or the peer is done (see :meth:`ThreadLoan.lend_reads`)."""
        return bool(self._closed or self._eof or not self._handshaken or self._bulk is not None
                    or self._end > self._start or self._frames or self._paused_reading)

    def take_lent_input(self, frames: Any, data: bytes) -> None:
        """The read side comes back (``ThreadLoan.take_back``, on the loop): ``frames``, then
        ``data``, are taken as if just read; then the loan ends and reading resumes."""
        if frames:
            self._frames.extend(frames)
            self._wake()
        # (Still marked lent meanwhile, so that no on_idle lends it again half-way.)
        view = memoryview(data)
        while view.nbytes and not self._transport.is_closing():
            target = self.get_buffer(view.nbytes)
            count = min(target.nbytes, view.nbytes)
            target[:count] = view[:count]
            view = view[count:]
            self.buffer_updated(count)
        self.loan.recall = None
        if not self._paused_reading and not self._transport.is_closing():  # (else read() resumes it)
            self._transport.resume_reading()

    @property
    def must_drain(self) -> bool:
        """True while the socket's send buffer is above its high-water mark (or, under TLS,
        a bulk payload is still being written)."""
        return self.writer.must_drain

    async def read(self) -> Any:
        """The next incoming frame, or ``grpc.aio.EOF`` once the connection ended (server ``context``)."""
        while not self._frames:
            if self._closed or self._eof:
                return grpc.aio.EOF
            if self.on_idle is not None and self.loan.recall is None:
                self.on_idle()
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
            self.writer.close()


async def serve(address: str, token: str, parse: Callable[[bytes], Any],
                on_connection: Callable[[FrameConnection], None],
                max_bulk: int, ssl_context: Any = None) -> tuple[asyncio.AbstractServer, int]:
    """Listen on ``address:0``; each authenticated connection goes to ``on_connection``.
    ``max_bulk``: the largest bulk payload a client may send; ``ssl_context``: mutual TLS
    (:meth:`podium.auth.TlsConfig.ssl_context`). Returns the server and its port.
    """
    loop = asyncio.get_running_loop()
    gate = PreAuthGate()
    server = await loop.create_server(
        lambda: FrameConnection(parse, token=token, server=True, on_ready=on_connection, max_bulk=max_bulk,
                                gate=gate),
        host=address.strip("[]"), port=0, ssl=ssl_context,
        ssl_handshake_timeout=HANDSHAKE_SECONDS if ssl_context is not None else None)
    port = server.sockets[0].getsockname()[1]
    return server, port


async def connect(host: str, port: int, token: str, parse: Callable[[bytes], Any],
                  on_frame: Callable[[Any], None], on_lost: Callable[[BaseException | None], None],
                  timeout: float | None = 30.0, max_bulk: int = 0, ssl_context: Any = None,
                  server_hostname: str | None = None) -> FrameConnection:
    """Open and authenticate a client connection; frames go to ``on_frame`` as they arrive.
    ``max_bulk``: the largest bulk payload the worker may send back; ``ssl_context`` and
    ``server_hostname`` (the name its certificate must carry): mutual TLS."""
    loop = asyncio.get_running_loop()

    async def go() -> FrameConnection:
        _, conn = await loop.create_connection(
            lambda: FrameConnection(parse, token=token, server=False, on_frame=on_frame, on_lost=on_lost,
                                    max_bulk=max_bulk),
            host=host.strip("[]"), port=port, ssl=ssl_context,
            server_hostname=server_hostname if ssl_context is not None else None)
        try:
            await conn.ready
        except BaseException:
            conn.close()
            raise
        return conn

    return await asyncio.wait_for(go(), timeout)
