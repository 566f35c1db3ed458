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
frames through a callback as they arrive (no reader task, no queue).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import os
import socket
import struct
import threading
from typing import Any, Callable

import grpc

from podium import errors
from podium.memorypool import MIN_POOLED_BYTES, POOL
from podium.transport.chunks import CHUNK_SIZE
from podium.transport.frames import BULK_FLAG, FRAME_LENGTH

__all__ = ["MAGIC", "VERSION", "MAX_FRAME_BYTES", "BULK_MIN_BYTES", "BulkFrame", "FrameConnection", "serve",
           "connect"]

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
_SCRATCH = 1 << 20
# Under TLS a bulk payload is written in slices of this size: uvloop encrypts each write
# whole before sending any of it, so one 128 MiB write runs at ~300 MB/s where 1 MiB
# slices reach ~850 MB/s (encryption and sending overlap).
_TLS_SLICE = 1 << 20
# The send buffer's high-water mark (asyncio's default); the low one is 0 (connection_made).
_HIGH_WATER = 64 << 10
# How often a bulk write lent with ``on_sent`` is checked for having left, when the last
# bytes (below the high-water mark) sit in the event loop's buffer.
_SENT_POLL_SECONDS = 0.0005
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


class BulkFrame:
    """A bulk frame as it arrives: the ``message`` (its ``data`` empty) and the payload.

    ``data`` is a writable view of the payload in a reused mapping (it goes back to the
    pool when every value decoded from it is gone), or None with ``error`` set when the
    payload was refused (larger than this side's limit).
    """

    __slots__ = ("message", "data", "error")

    def __init__(self, message: Any, data: memoryview | None, error: errors.PodiumError | None = None) -> None:
        self.message = message
        self.data = data
        self.error = error


class _Bulk:
    """The payload of a bulk frame while its bytes arrive."""

    __slots__ = ("message", "size", "received", "buffer", "view", "error")

    def __init__(self, message: Any, size: int, max_size: int) -> None:
        self.message = message
        self.size = size
        self.received = 0
        self.error: errors.PodiumError | None = None
        self.buffer: Any = None  # a pooled mapping, for a payload of MIN_POOLED_BYTES or more
        if size > max_size:  # refused before any memory is taken for it
            self.error = errors.PayloadTooLargeError(
                f"payload of {size} bytes exceeds the maximum of {max_size} bytes",
                details={"size": str(size), "max_size": str(max_size)})
            self.view = memoryview(bytearray(min(size, _SCRATCH)))
        elif size < MIN_POOLED_BYTES:  # small: malloc reuses its heap, a mapping is 1 MiB at least
            self.view = memoryview(bytearray(size))
        else:
            self.buffer = POOL.take(size)
            self.view = memoryview(self.buffer)

    def target(self) -> memoryview:
        """Where the next bytes go (never past the payload's end)."""
        left = self.size - self.received
        if self.error is not None:
            return self.view[:min(left, len(self.view))]
        return self.view[self.received:self.size]

    def add(self, nbytes: int) -> None:
        self.received += nbytes

    def fill(self, data: memoryview) -> None:
        """Copy bytes that arrived in the frame buffer (after the message) into place."""
        if self.error is None:
            self.view[self.received:self.received + len(data)] = data
        self.received += len(data)

    def finish(self) -> BulkFrame:
        if self.error is not None:
            return BulkFrame(self.message, None, self.error)
        if self.buffer is None:
            return BulkFrame(self.message, self.view)
        self.view.release()
        return BulkFrame(self.message, POOL.lease(self.buffer, self.size))

    def abandon(self) -> None:
        """The connection ended mid-payload: the mapping goes back, nothing leaks."""
        if self.buffer is not None:
            self.view.release()
            POOL.give_back(self.buffer)
            self.buffer = None


class FrameConnection(asyncio.BufferedProtocol):
    """One side of a raw call connection (see the module docstring).

    ``parse`` turns bytes into the incoming message type. With ``on_frame`` every
    incoming frame (or :class:`BulkFrame`) is handed to it at once (client); without,
    frames queue for :meth:`read` (server). ``on_lost(exc)`` runs once when the
    connection ends. ``max_bulk`` is the largest bulk payload this side accepts.
    """

    def __init__(self, parse: Callable[[bytes], Any], *, token: str | None = None, server: bool,
                 on_frame: Callable[[Any], None] | None = None,
                 on_ready: Callable[["FrameConnection"], None] | None = None,
                 on_lost: Callable[[BaseException | None], None] | None = None,
                 max_bulk: int = 0) -> None:
        self._parse = parse
        self._token = token
        self._server = server
        self._on_frame = on_frame
        self._on_ready = on_ready
        self._on_lost = on_lost
        self._max_bulk = max_bulk
        # Frames are read into _buffer[_start:_end]; never resized in place (the event loop
        # may still hold a view of it), replaced by a larger one when a frame needs it.
        self._buffer = bytearray(_READ_BUFFER)
        self._start = self._end = 0
        self._bulk: _Bulk | None = None
        self._encrypted = False
        self._handshaken = False
        # Set by connection_made, before any other method can run.
        self._transport: Any = None
        self._frames: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        #: Server side: ``take_now(frame)`` is offered each frame that arrives while the reader
        #: waits with nothing queued, and returns True when it handled the frame on the spot
        #: (no queue, future or task step: a no-op call's hot path). Frames it declines, and
        #: every frame behind one still queued, go to :meth:`read` in arrival order.
        self.take_now: Callable[[Any], bool] | None = None
        #: Server side: ``on_idle()`` runs when the reader is about to wait with nothing
        #: queued, the moment :meth:`lend_reads` can be offered.
        self.on_idle: Callable[[], None] | None = None
        # While another thread reads the socket (lend_reads): its recall(), else None.
        self._lent: Callable[[], None] | None = None
        self._drained: asyncio.Future | None = None
        self._paused_writing = False
        self._paused_reading = False
        self._pending: list[bytes] = []
        self._flush_scheduled = False
        # write_from_thread: a second descriptor of the socket (server side, plain TCP) that
        # another thread sends on; the lock orders its sends with the loop's writes, and
        # _tail holds what such a send left unsent, which goes before anything else.
        self._direct: socket.socket | None = None
        self._write_lock = threading.Lock()
        self._tail: memoryview | None = None
        # Under TLS a bulk payload is written by a task as the socket drains (see
        # write_bulk); what is written meanwhile waits here, in order, behind it.
        self._outbox: collections.deque = collections.deque()
        self._sender: asyncio.Task | None = None
        self._close_when_sent = False
        # Called once everything written so far has left this process (see write_bulk's
        # ``on_sent``), or the connection ended.
        self._on_empty: list[Callable[[], None]] = []
        self._closed = False
        self._eof = False  # the peer closed its side (server)
        self.lost_error: BaseException | None = None
        #: Resolves when the handshake is done (True) or failed (exception).
        self._loop = asyncio.get_running_loop()
        self.ready: asyncio.Future = self._loop.create_future()

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._encrypted = transport.get_extra_info("sslcontext") is not None
        if not self._encrypted:
            # resume_writing then means "nothing left in this process" (see write_bulk's on_sent).
            transport.set_write_buffer_limits(high=_HIGH_WATER, low=0)  # type: ignore[attr-defined]
            sock = transport.get_extra_info("socket")
            if self._server and sock is not None:  # for write_from_thread
                self._direct = socket.socket(fileno=os.dup(sock.fileno()))
        if self._server:  # a peer that never says hello must not hold a socket forever
            asyncio.get_running_loop().call_later(HANDSHAKE_SECONDS, self._handshake_deadline)
        else:
            token = (self._token or "").encode()
            transport.write(_HELLO.pack(MAGIC, VERSION, len(token)) + token)  # type: ignore[attr-defined]

    def get_buffer(self, sizehint: int) -> memoryview:
        bulk = self._bulk
        if bulk is not None:
            return bulk.target()
        buffer = self._buffer
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
        elif self.on_idle is not None and self._lent is None and self._waiter is not None \
                and not self._waiter.done():  # take_now took every frame: the reader still waits
            self.on_idle()

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
            bulk = _Bulk(message, size, self._max_bulk)
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
        waiter, take_now = self._waiter, self.take_now
        if take_now is not None and not self._frames and waiter is not None and not waiter.done() \
                and take_now(frame):
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
            if available < _HELLO.size + length:
                return False
            offered = bytes(buffer[start + _HELLO.size:start + _HELLO.size + length])
            self._start += _HELLO.size + length
            if not hmac.compare_digest(offered, (self._token or "").encode()):
                self._transport.write(_REJECTED)
                self._abort(errors.AuthenticationError("raw call connection with a wrong token"))
                return False
            self._transport.write(_ACCEPTED)
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

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lent is not None:  # the borrower's descriptor keeps the socket open until it lets go
            self._lent()
        with self._write_lock:
            self._closed = True
            if self._direct is not None:  # the socket ends with its last descriptor
                self._direct.close()
                self._direct = None
        if self._bulk is not None:  # cut mid-payload: its buffer goes back
            self._bulk.abandon()
            self._bulk = None
            if exc is None:
                exc = errors.DataLossError("the connection ended in the middle of a payload")
        if self.lost_error is None:
            self.lost_error = exc
        if not self.ready.done():
            self.ready.set_exception(errors.UnavailableError(
                f"raw call connection closed during the handshake: {exc or 'EOF'}"))
            self.ready.exception()  # retrieved by whoever awaits; never "never retrieved"
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._sent_all()  # nothing more will be read from lent memory
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
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if self._on_empty and not self._encrypted:
            self._check_sent()

    def _check_sent(self) -> None:
        if self._closed or not self._transport.get_write_buffer_size():
            self._sent_all()
        elif not self._paused_writing:  # a remainder below the high-water mark: no resume_writing
            asyncio.get_running_loop().call_later(_SENT_POLL_SECONDS, self._check_sent)

    def _sent_all(self) -> None:
        callbacks, self._on_empty = self._on_empty, []
        for callback in callbacks:
            callback()

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

    def lend_reads(self, recall: Callable[[], None]) -> socket.socket | None:
        """Let another thread read the socket (server side, plain TCP, on the loop).

        Returns a descriptor of the socket that the borrower reads from and closes, or None
        when the read side cannot go now: the connection is not a handshaken plain-TCP server
        one, or bytes, frames or a bulk payload are still in hand here. The loop reads
        nothing until :meth:`take_back`; ``recall()`` asks for it back (it runs when the
        connection ends). Writing is not lent: the borrower answers with
        :meth:`write_from_thread`.
        """
        if (self._direct is None or self._closed or self._eof or self._lent is not None or not self._handshaken
                or self._bulk is not None or self._end > self._start or self._frames or self._paused_reading
                or self._transport.is_closing()):
            return None
        sock = socket.socket(fileno=os.dup(self._direct.fileno()))
        self._lent = recall
        self._transport.pause_reading()
        return sock

    def take_back(self, frames: Any = (), data: bytes = b"") -> None:
        """The borrower of :meth:`lend_reads` lets go (on the loop): ``frames`` it parsed but
        did not handle, then ``data``, the bytes it read after them, are taken as if this
        side had just read them, and reading resumes."""
        if self._closed or self._transport.is_closing():
            self._lent = None
            return
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
        self._lent = None
        if not self._paused_reading and not self._transport.is_closing():  # (else read() resumes it)
            self._transport.resume_reading()

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
            self._write(_LEN.pack(len(data)), data)
            return
        self._pending.append(_LEN.pack(len(data)) + data)
        if len(self._pending) >= _COALESCE_FRAMES:
            self._flush()  # a long burst: let the peer start on the first frames meanwhile
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def write_bulk(self, message: bytes, segments: Any, nbytes: int,
                   on_sent: Callable[[], None] | None = None) -> None:
        """Queue a bulk frame: the serialized ``message``, then the payload ``segments``
        (``nbytes`` in all) as they lie in memory. Never blocks (see :meth:`drain`); the
        event loop keeps a reference to each segment until it is sent.

        ``on_sent()`` runs on the loop once nothing in this process reads the segments'
        memory any more: their bytes are in the kernel's socket buffer (under TLS: the
        ciphertext was made), or the connection ended. Until then a change to that memory
        would change what the peer receives."""
        if self._closed:
            raise errors.UnavailableError("the raw call connection is closed")
        self._flush()
        head = _BULK.pack(_BULK_FLAG | len(message), nbytes) + message
        if not self._encrypted:
            self._write(head, *[segment for segment in segments if segment.nbytes])
            if on_sent is not None:
                self._on_empty.append(on_sent)
                self._check_sent()
            return
        # uvloop encrypts each write at once and keeps the ciphertext until the socket takes
        # it, and a long backlog makes every further write slower: 1 GiB written in one go
        # took 15 s (512 MiB 3.8 s), and the event loop was blocked meanwhile, so the peer's
        # liveness pings went unanswered. So a task writes it in slices as the socket drains.
        self._outbox.append((head, segments, on_sent))
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send_outbox())

    def _write(self, *parts: Any) -> None:
        """Write ``parts`` in order, with nothing from write_from_thread between them."""
        if self._sender is not None:
            self._outbox.extend(parts)  # behind a bulk payload still being written
            return
        with self._write_lock:
            if self._tail is not None:
                self._write_tail_locked()
            for data in parts:
                self._transport.write(data)

    def write_from_thread(self, message: bytes) -> bool:
        """Send a small serialized message from a thread other than the loop's, without
        waking the loop (server side, plain TCP). It goes only when nothing is queued ahead
        of it; then it is sent, or its unsent rest is queued for the loop to write before
        anything else (True). False: nothing was written; write it on the loop instead."""
        data = _LEN.pack(len(message)) + message
        with self._write_lock:
            direct = self._direct
            if (direct is None or self._closed or self._pending or self._tail is not None
                    or self._sender is not None or self._transport.is_closing()
                    or self._transport.get_write_buffer_size()):
                return False
            try:
                sent = direct.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError:  # the loop's own write meets the same error and ends the connection
                return False
            if sent < len(data):
                self._tail = memoryview(data)[sent:]
                self._loop.call_soon_threadsafe(self._write_tail)
        return True

    def _write_tail(self) -> None:
        with self._write_lock:
            if self._tail is not None and not self._closed:
                self._write_tail_locked()

    def _write_tail_locked(self) -> None:
        tail, self._tail = self._tail, None
        self._transport.write(tail)

    async def _send_outbox(self) -> None:
        transport = self._transport
        on_sent = None
        try:
            while self._outbox and not self._closed:
                item = self._outbox.popleft()
                if type(item) is not tuple:
                    transport.write(item)
                    continue
                head, segments, on_sent = item
                transport.write(head)
                for segment in segments:
                    view = memoryview(segment).cast("B") if segment.nbytes else segment
                    for at in range(0, view.nbytes, _TLS_SLICE):
                        if self._paused_writing:
                            await self.drain()
                        if self._closed:
                            return
                        transport.write(view[at:at + _TLS_SLICE])
                # TLS encrypts each write at once: the plaintext is not read any more.
                on_sent, done = None, on_sent
                if done is not None:
                    done()
        finally:
            self._sender = None
            if on_sent is not None and not self._closed:  # failed mid-payload: the stream cannot go on
                self._abort(errors.DataLossError("a bulk write stopped in the middle of its payload"))
            if self._closed or on_sent is not None:
                lent = [on_sent] + [item[2] for item in self._outbox if type(item) is tuple]
                self._outbox.clear()
                for done in lent:
                    if done is not None:
                        done()
            elif self._close_when_sent:
                transport.close()

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending = self._pending
        if not pending or self._closed:
            pending.clear()
            return
        self._write(pending[0] if len(pending) == 1 else b"".join(pending))
        pending.clear()

    @property
    def must_drain(self) -> bool:
        """True while the socket's send buffer is above its high-water mark (or, under TLS,
        a bulk payload is still being written)."""
        return (self._paused_writing or self._sender is not None) and not self._closed

    async def drain(self) -> None:
        """Wait until the send buffer is below its high-water mark and no bulk payload is
        still being written (or the connection ended)."""
        sender = self._sender
        if sender is not None and sender is not asyncio.current_task():
            await asyncio.shield(sender)
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
            if self._closed or self._eof:
                return grpc.aio.EOF
            if self.on_idle is not None and self._lent is None:
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
            self._flush()
            if self._sender is not None:
                self._close_when_sent = True  # the sender closes it after the last slice
                return
            self._transport.close()


async def serve(address: str, token: str, parse: Callable[[bytes], Any],
                on_connection: Callable[[FrameConnection], None],
                max_bulk: int, ssl_context: Any = None) -> tuple[asyncio.AbstractServer, int]:
    """Listen on ``address:0``; each authenticated connection goes to ``on_connection``.
    ``max_bulk``: the largest bulk payload a client may send; ``ssl_context``: mutual TLS
    (:meth:`podium.auth.TlsConfig.ssl_context`). Returns the server and its port.
    """
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: FrameConnection(parse, token=token, server=True, on_ready=on_connection, max_bulk=max_bulk),
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
