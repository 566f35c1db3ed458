"""The sending side of a raw call connection (:mod:`podium.transport.callsocket`).

:class:`FrameWriter` queues frames on the connection's transport: small frames written in
one loop turn leave in one send; a bulk frame's payload is written from its own memory (and
``on_sent`` says when nothing reads that memory any more); under TLS a task writes bulk
payloads in slices as the socket drains, with whatever is written meanwhile queued behind
them. Every write is made under the connection's :class:`~podium.transport.threadloan.ThreadLoan`
lock, after what a thread's send left unsent, so the two never interleave.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

from podium import errors
from podium.transport.frames import BULK_FLAG, FRAME_LENGTH
from podium.transport.threadloan import ThreadLoan

__all__ = ["FrameWriter"]

_LEN = FRAME_LENGTH
_BULK = struct.Struct("<IQ")
# Under TLS a bulk payload is written in slices of this size: uvloop encrypts each write
# whole before sending any of it, so one 128 MiB write runs at ~300 MB/s where 1 MiB
# slices reach ~850 MB/s (encryption and sending overlap).
_TLS_SLICE = 1 << 20
# How often a bulk write lent with ``on_sent`` is checked for having left, when the last
# bytes (below the high-water mark) sit in the event loop's buffer.
_SENT_POLL_SECONDS = 0.0005
# Frames smaller than this wait for the end of the loop turn to leave together,
# at most this many at a time.
_COALESCE_MAX = 65536
_COALESCE_FRAMES = 16


class _FlushBatch:
    """The writers of one event loop holding small frames to send at the end of this loop
    turn: one callback flushes them all, so a fan-out to N connections schedules one
    callback, not N."""

    __slots__ = ("loop", "writers")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.writers: list[FrameWriter] = []

    def add(self, writer: FrameWriter) -> None:
        """Flush ``writer`` at the end of this loop turn (on the loop)."""
        writers = self.writers
        writers.append(writer)
        if len(writers) == 1:
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send what every writer added holds (a writer flushed meanwhile has nothing)."""
        writers, self.writers = self.writers, []
        for writer in writers:
            writer._flush()


_batches: dict[asyncio.AbstractEventLoop, _FlushBatch] = {}


def _batch_of(loop: asyncio.AbstractEventLoop) -> _FlushBatch:
    batch = _batches.get(loop)
    if batch is None or batch.loop is not loop:
        for old in [old for old in list(_batches) if old.is_closed()]:  # loops of ended tests, threads
            _batches.pop(old, None)
        batch = _batches[loop] = _FlushBatch(loop)
    return batch


class FrameWriter:
    """One connection's sending side (see the module docstring). ``abort(exc)`` ends the
    connection (a bulk write that stopped half-way)."""

    def __init__(self, loan: ThreadLoan, abort: Callable[[BaseException], None]) -> None:
        self._loan = loan
        self._abort = abort
        self._transport: Any = None  # set by attach, before any write
        self._encrypted = False
        #: True once the connection has ended (set by the connection, under the loan's lock).
        self.closed = False
        self._drained: asyncio.Future | None = None
        self._paused_writing = False
        self._pending: list[bytes] = []
        self._flush_scheduled = False
        self._batch: _FlushBatch | None = None  # the loop's (set on the first small write)
        # Under TLS a bulk payload is written by a task as the socket drains (see
        # write_bulk); what is written meanwhile waits here, in order, behind it.
        self._outbox: collections.deque = collections.deque()
        self._sender: asyncio.Task | None = None
        self._close_when_sent = False
        # Called once everything written so far has left this process (see write_bulk's
        # ``on_sent``), or the connection ended.
        self._on_empty: list[Callable[[], None]] = []
        # Resolved when the connection ends: a send on a second descriptor of the socket
        # (_send_copying) waits on that descriptor, which the transport's close leaves open.
        self._ended: asyncio.Future | None = None

    def attach(self, transport: Any, encrypted: bool) -> None:
        """Write on ``transport`` from now on (connection_made)."""
        self._transport = transport
        self._encrypted = encrypted

    @property
    def sends_while_copying(self) -> bool:
        """Whether a bulk payload can be sent from the caller's memory while it is copied
        (:mod:`podium.transport.copyonsend`): plain TCP only, as uvloop encrypts each write
        of a TLS connection on the loop, from memory it keeps."""
        return self._transport is not None and not self._encrypted

    # ---------------------------------------------------------------- flow control

    def pause(self) -> None:
        """The transport's ``pause_writing``."""
        self._paused_writing = True

    def resume(self) -> None:
        """The transport's ``resume_writing``."""
        self._paused_writing = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if self._on_empty and not self._encrypted:
            self._check_sent()

    def _check_sent(self) -> None:
        if self.closed or not self._transport.get_write_buffer_size():
            self._sent_all()
        elif not self._paused_writing:  # a remainder below the high-water mark: no resume_writing
            asyncio.get_running_loop().call_later(_SENT_POLL_SECONDS, self._check_sent)

    def _sent_all(self) -> None:
        callbacks, self._on_empty = self._on_empty, []
        for callback in callbacks:
            callback()

    def end(self) -> None:
        """The connection ended (connection_lost, after ``closed`` is set): wake a drain,
        and tell every ``on_sent`` that nothing reads lent memory any more."""
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)
        self._sent_all()

    def holds_output(self) -> bool:
        """True while something written here has not left this process (or the connection
        ends): a thread's write must not pass it (see ThreadLoan.write_from_thread)."""
        transport = self._transport
        return bool(self.closed or self._pending or self._sender is not None or transport.is_closing()
                    or transport.get_write_buffer_size())

    # ---------------------------------------------------------------- writing

    def write_nowait(self, message: Any) -> None:
        """Queue ``message`` on the socket (never blocks; see :meth:`drain`).

        Small frames written in one loop turn leave in one send (a burst of calls or
        replies costs one system call and one wake-up of the peer, not one per frame).
        """
        self.write_serialized_nowait(message.SerializeToString())

    def write_serialized_nowait(self, data: bytes) -> None:
        """:meth:`write_nowait` of a message already serialized to ``data``."""
        if self.closed:
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
            batch = self._batch
            if batch is None:
                batch = self._batch = _batch_of(asyncio.get_running_loop())
            batch.add(self)

    def write_bulk(self, message: bytes, segments: Any, nbytes: int,
                   on_sent: Callable[[], None] | None = None, copying: Any = None) -> None:
        """Queue a bulk frame: the serialized ``message``, then the payload ``segments``
        (``nbytes`` in all) as they lie in memory. Never blocks (see :meth:`drain`); the
        event loop keeps a reference to each segment until it is sent.

        ``on_sent()`` runs on the loop once nothing in this process reads the segments'
        memory any more: their bytes are in the kernel's socket buffer (under TLS: the
        ciphertext was made), or the connection ended. Until then a change to that memory
        would change what the peer receives.

        ``copying``: a :class:`~podium.transport.copyonsend.CopyOnSend` still copying the
        segments' buffers (only where :attr:`sends_while_copying`): a task sends them from
        the caller's memory meanwhile, with whatever is written after them queued behind."""
        if self.closed:
            raise errors.UnavailableError("the raw call connection is closed")
        self._flush()
        head = _BULK.pack(BULK_FLAG | len(message), nbytes) + message
        if copying is not None:
            self._queue_bulk(head, segments, on_sent, copying)
            return
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
        self._queue_bulk(head, segments, on_sent, None)

    def _queue_bulk(self, head: bytes, segments: Any, on_sent: Callable[[], None] | None, copying: Any) -> None:
        self._outbox.append((head, segments, on_sent, copying))
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send_outbox())

    def _write(self, *parts: Any) -> None:
        """Write ``parts`` in order, with nothing from a thread's write between them."""
        if self._sender is not None:
            self._outbox.extend(parts)  # behind a bulk payload still being written
            return
        loan = self._loan
        with loan.lock:
            if loan.tail is not None:
                loan.write_tail_locked()
            for data in parts:
                self._transport.write(data)

    async def _send_outbox(self) -> None:
        transport = self._transport
        on_sent = None
        midway = False  # a payload is half-written: the stream cannot go on if this stops
        try:
            while self._outbox and not self.closed:
                item = self._outbox.popleft()
                if type(item) is not tuple:
                    transport.write(item)
                    continue
                head, segments, on_sent, copying = item
                midway = True
                if copying is not None:
                    await self._send_copying(head, segments, copying)
                    midway, done, on_sent = False, on_sent, None
                    if done is not None:  # the copy's rest may still be in the transport's buffer
                        self._on_empty.append(done)
                        self._check_sent()
                    continue
                transport.write(head)
                for segment in segments:
                    view = memoryview(segment).cast("B") if segment.nbytes else segment
                    for at in range(0, view.nbytes, _TLS_SLICE):
                        if self._paused_writing:
                            await self.drain()
                        if self.closed:
                            return
                        transport.write(view[at:at + _TLS_SLICE])
                # TLS encrypts each write at once: the plaintext is not read any more.
                midway, done, on_sent = False, on_sent, None
                if done is not None:
                    done()
        finally:
            self._sender = None
            if midway and not self.closed:
                self._abort(errors.DataLossError("a bulk write stopped in the middle of its payload"))
            if self.closed or midway:
                lent = [on_sent] + [item[2] for item in self._outbox if type(item) is tuple]
                self._outbox.clear()
                for done in lent:
                    if done is not None:
                        done()
            elif self._close_when_sent:
                transport.close()

    async def _send_copying(self, head: bytes, segments: Any, copying: Any) -> None:
        """Send a bulk frame whose buffers are still being copied (see :meth:`write_bulk`):
        on a second descriptor of the socket, once what the transport holds has left."""
        loan = self._loan
        with loan.lock:  # what a thread's send left unsent goes first
            if loan.tail is not None:
                loan.write_tail_locked()
        if self._transport.get_write_buffer_size():
            emptied = asyncio.get_running_loop().create_future()

            def sent() -> None:
                if not emptied.done():
                    emptied.set_result(None)

            self._on_empty.append(sent)
            self._check_sent()
            await emptied
        if self.closed:
            raise errors.UnavailableError("the raw call connection is closed")
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        sock = socket.socket(fileno=os.dup(self._transport.get_extra_info("socket").fileno()))
        try:
            sock.setblocking(False)  # as the transport's own descriptor already is
            await copying.send(sock, self._transport, [memoryview(head), *segments], self._ended)
        finally:
            sock.close()  # the socket ends with the transport's descriptor and this one

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending = self._pending
        if not pending or self.closed:
            pending.clear()
            return
        self._write(pending[0] if len(pending) == 1 else b"".join(pending))
        pending.clear()

    @property
    def must_drain(self) -> bool:
        """True while the socket's send buffer is above its high-water mark (or, under TLS,
        a bulk payload is still being written)."""
        return (self._paused_writing or self._sender is not None) and not self.closed

    async def drain(self) -> None:
        """Wait until the send buffer is below its high-water mark and no bulk payload is
        still being written (or the connection ended)."""
        sender = self._sender
        if sender is not None and sender is not asyncio.current_task():
            await asyncio.shield(sender)
        while self._paused_writing and not self.closed:
            if self._drained is None or self._drained.done():
                self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    async def write(self, message: Any) -> None:
        """Send ``message``, waiting for room when the peer reads slowly."""
        self.write_nowait(message)
        if self._paused_writing:
            await self.drain()

    def close(self) -> None:
        """Close the transport once what is queued is written (on the loop, while open)."""
        self._flush()
        if self._sender is not None:
            self._close_when_sent = True  # the sender closes it after the last slice
            return
        self._transport.close()
