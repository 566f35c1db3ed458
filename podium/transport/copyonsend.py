"""A non-blocking call's arguments snapshotted by sending them, over plain TCP.

A call that returns before its arguments are sent must send them as they were when it
returned (:meth:`podium.codec.Encoded.snapshot`). Copying a 128 MiB payload before returning
and sending it afterwards puts one memcpy in series with the send: +9-18% on the 128 MiB
round trip on two cores. A byte in the kernel's socket buffer is a snapshot too, and sending
it is work the call does anyway. So :class:`CopyOnSend` has the connection's event loop send
the buffers straight out of the caller's memory (:meth:`CopyOnSend.send`) while the caller
waits (:meth:`CopyOnSend.run`); a send that finishes within a grace period (the payload's
size at ``_GRACE_BYTES_PER_SECOND``) costs no copy at all. A send slower than that (a slow
link, a peer that reads slowly or not at all) gets the rest copied into pooled memory from
the back while it goes on from the front; where the two meet the call returns, and the loop
sends the rest from the copy. A call so returns within ``grace + one memcpy`` at most.

Copying beside the send from the start was measured too: on two cores the copy slows the
send as much as it saves (both are memory-bound), so the round trip gained little.

A byte is never read from the caller's memory once the call has returned: the loop claims a
range of it under a lock before one non-blocking ``send`` and gives back what the kernel did
not take, and the call returns only once no claim is open and every byte above the sender's
front is copied.
"""

from __future__ import annotations

import asyncio
import ctypes
import socket
import threading
from typing import Any

from podium import errors

__all__ = ["CopyOnSend"]

# The copier's step: the sender waits at most one slice's memcpy where the two meet, and
# the lock costs nothing beside it.
_COPY_SLICE = 1 << 20
# The most the sender claims for one send: about what a socket buffer takes at once.
_SEND_CLAIM = 4 << 20
# How long the caller leaves its arguments to the send before it copies what is left: the
# time the payload takes at this rate (loopback TCP here sends at ~4.5 GB/s, a 25 Gb/s link
# at ~3), at least the floor below.
_GRACE_BYTES_PER_SECOND = 2 << 30
_GRACE_MIN_SECONDS = 0.002
# A claim lasts one non-blocking send and a slice one memcpy: a caller that waits longer than
# this for them has met a broken process, and fails its call rather than return while its
# memory may still be read.
_STUCK_SECONDS = 10.0


class CopyOnSend:
    """The snapshot of ``sources`` into ``copies`` (views of one pooled mapping, same sizes, in
    order): sent by :meth:`send` on ``loop``, the rest copied by :meth:`run`.

    Offsets here are in the buffers' concatenation, which is how the copies lie in the mapping.
    Bytes ``[0, front)`` are sent (or in the sender's one open claim), ``[low, total)`` are
    claimed by copiers, and copied once no copier slice is in flight; ``front <= low``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sources: list[memoryview],
                 copies: list[memoryview]) -> None:
        import numpy as np

        self._loop = loop
        self._sources = [s if s.ndim == 1 and s.itemsize == 1 else s.cast("B") for s in sources]
        #: Where the snapshot lies: the buffers of the payload that is sent.
        self.copies = copies
        self._starts: list[int] = []
        at = 0
        for copy in copies:
            self._starts.append(at)
            at += copy.nbytes
        self.total = at
        self._src = [np.frombuffer(s, dtype=np.uint8).ctypes.data for s in self._sources]
        self._dst = [np.frombuffer(c, dtype=np.uint8).ctypes.data for c in copies]
        self._cond = threading.Condition(threading.Lock())
        self._front = 0
        self._low = at
        self._copying = 0        # copier slices in flight
        self._sending = False    # the sender's claim is open
        self._waker: asyncio.Future | None = None  # the sender waits for slices in flight
        self._failed = False
        #: Bytes sent straight from the caller's memory when :meth:`run` returned (the rest
        #: was copied); -1 before.
        self.sent_directly = -1
        #: Resolves on ``loop`` once the copy is finished (see :meth:`check`).
        self.copied: asyncio.Future = loop.create_future()
        self._ended: asyncio.Future | None = None  # resolves when the connection ends (send)

    # ---------------------------------------------------------------- the caller's thread

    def run(self) -> None:
        """Make the snapshot on the caller's thread, once the call is queued (see the module
        docstring); return once the caller's memory is not read any more, so the call may
        return. Raises ``DeadlineExceededError`` (the sender then gives up and ends the
        connection) if a claim never ends."""
        cond = self._cond
        try:
            grace = max(_GRACE_MIN_SECONDS, self.total / _GRACE_BYTES_PER_SECOND)
            with cond:
                cond.wait_for(self._met_locked, grace)
            self._copy()  # the send has not taken it all: copy the rest
            with cond:
                if not cond.wait_for(self._met_locked, _STUCK_SECONDS):
                    raise errors.DeadlineExceededError(
                        f"the snapshot of this call's arguments did not finish in {_STUCK_SECONDS:.0f} s; "
                        "the call fails rather than return while its arguments may still be read")
                self.sent_directly = self._front
        except BaseException:
            with cond:
                self._failed = True
            raise
        finally:
            self._wake_sender()
            self._loop.call_soon_threadsafe(_wake, self.copied)

    def check(self) -> None:
        """Raise ``DataLossError`` if :meth:`run` failed (once :attr:`copied`): the copy is
        incomplete and must not be sent."""
        if self._failed:
            raise errors.DataLossError("the copy of a call's arguments failed; they were not sent")

    def _met_locked(self) -> bool:
        return self._front >= self._low and not self._copying and not self._sending

    def _copy(self) -> None:
        """Copy slices from the top of what is unclaimed until the sender's front (any thread)."""
        cond = self._cond
        k = len(self.copies) - 1
        while True:
            with cond:
                top = self._low
                while k > 0 and self._starts[k] >= top:
                    k -= 1
                low = max(self._front, top - _COPY_SLICE, self._starts[k])  # within one buffer
                if low >= top or self._failed:
                    return
                self._low = low
                self._copying += 1
            try:
                offset = low - self._starts[k]
                ctypes.memmove(self._dst[k] + offset, self._src[k] + offset, top - low)
            finally:
                with cond:
                    self._copying -= 1
                    last = not self._copying
                    if last:
                        cond.notify_all()
                if last:
                    self._wake_sender()

    def _wake_sender(self) -> None:
        with self._cond:
            waker, self._waker = self._waker, None
        if waker is not None:
            self._loop.call_soon_threadsafe(_wake, waker)

    # ---------------------------------------------------------------- the event loop

    async def send(self, sock: socket.socket, transport: Any, segments: list[memoryview],
                   ended: asyncio.Future) -> None:
        """Send ``segments`` (the wire form of the copies' payload, whose buffers are
        :attr:`copies`) on ``sock``, a non-blocking descriptor of ``transport``'s socket, while
        :meth:`run` copies; once the rest is copied it goes to ``transport.write`` (whose
        buffer must be empty when this starts). Raises ``DataLossError`` if the copy failed
        (the payload cannot be finished: end the connection), ``UnavailableError`` once
        ``ended`` resolves (the connection ended) while it waits for the socket."""
        self._ended = ended
        index = {id(copy): k for k, copy in enumerate(self.copies)}
        for i, segment in enumerate(segments):
            k = index.get(id(segment))
            if k is None:  # the header, skeleton or padding: memory of the payload's own
                await self._send_all(sock, segment)
                continue
            start = self._starts[k]
            at = await self._send_from_caller(sock, k, start, start + segment.nbytes)
            if at is not None:  # the rest is copied: the transport sends it from the copy
                transport.write(self.copies[k][at - start:])
                for rest in segments[i + 1:]:
                    if rest.nbytes:
                        transport.write(rest)
                return

    async def _send_from_caller(self, sock: socket.socket, k: int, at: int, end: int) -> int | None:
        """Send buffer ``k``'s ``[at, end)`` from the caller's memory while it is not copied;
        returns where the copied part starts (None: all of it sent)."""
        cond = self._cond
        while at < end:
            with cond:
                if self._failed:
                    raise errors.DataLossError("the copy of a call's arguments failed while they were sent")
                waker = None
                if at >= self._low:
                    if not self._copying:
                        return at
                    waker = self._waker = self._loop.create_future()  # slices in flight above
                else:
                    claim = min(end, self._low, at + _SEND_CLAIM)
                    self._front, self._sending = claim, True
            if waker is not None:
                await waker
                continue
            offset = at - self._starts[k]
            sent = 0
            try:
                sent = sock.send(self._sources[k][offset:offset + claim - at])
            except BlockingIOError:
                pass
            finally:
                with cond:
                    self._front, self._sending = at + sent, False
                    cond.notify_all()
            at += sent
            if not sent:
                await self._writable(sock)
        return None

    async def _writable(self, sock: socket.socket) -> None:
        ended = self._ended
        assert ended is not None  # set by send, the only caller
        ready = self._loop.create_future()
        fd = sock.fileno()
        self._loop.add_writer(fd, _wake, ready)
        try:
            await asyncio.wait((ready, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._loop.remove_writer(fd)
        if not ready.done():
            raise errors.UnavailableError("the raw call connection ended while a payload was sent on it")

    async def _send_all(self, sock: socket.socket, data: memoryview) -> None:
        view = memoryview(data).cast("B") if data.nbytes else data
        while view.nbytes:
            try:
                view = view[sock.send(view):]
            except BlockingIOError:
                await self._writable(sock)


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
