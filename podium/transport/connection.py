"""One end of a call connection, the same code on both ends.

A controller's client of a worker and the worker's side of that client's calls hold one
:class:`CallConnection` each. It hides which carrier the frames take:

- the raw call socket (:class:`podium.transport.callsocket.FrameConnection`): frames are
  queued without awaiting (small ones leave together at the end of the loop turn) and a
  writer waits only while the socket's buffer is full; a large payload goes as one bulk
  frame (sent from the tensors' memory, received straight into its final buffer);
- the gRPC ``Calls`` stream (what TLS uses): one writer at a time, under a lock.

and owns what both ends do the same way: writing a payload as header + chunk frames,
bookkeeping frames that must never fail a call ("quiet" writes), and the shared-memory
segments of a same-host connection (:class:`podium.transport.sharedsegments.SharedSegments`: the
pool this side writes, the cache of what the peer wrote, and the frames that give segments
back). Frames are ``CallFrame`` one way and ``ReplyFrame`` the other; ``make_frame`` says
which this end writes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc

from podium import errors
from podium.transport import shm
from podium.transport.callsocket import BULK_MIN_BYTES, FrameConnection
from podium.transport.sharedsegments import SharedSegments

__all__ = ["CallConnection"]

log = logging.getLogger("podium.transport.connection")


class CallConnection:
    """Frames out and in on one call connection (raw socket or gRPC stream), either end.

    ``carrier`` has ``write(frame)`` and ``read()`` (``grpc.aio.EOF`` at the end): a raw
    :class:`FrameConnection`, a client's gRPC ``Calls`` call, or a server's stream context.
    ``shared_memory`` gives the connection its segment pool and cache (same-host peers only).
    """

    def __init__(self, carrier: Any, make_frame: Callable[..., Any], *, shared_memory: bool) -> None:
        self.carrier = carrier
        #: Whether frames can be queued without awaiting (the raw socket).
        self.writes_nowait = isinstance(carrier, FrameConnection)
        if self.writes_nowait:  # (the raw socket's own method: one call fewer per frame sent)
            self.write_serialized_nowait = carrier.write_serialized_nowait  # type: ignore[method-assign]
        self._make_frame = make_frame
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        #: Set once the connection is known to be gone: quiet writes stop.
        self.closed = False
        #: Reused shared-memory segments, both ways (None: the peer is on another host).
        self.segments: SharedSegments | None = (
            SharedSegments(self._loop, make_frame, self.send_quietly) if shared_memory else None)
        #: Whether the peer may name segments here: None until the first one it names.
        self._peer_may_name: bool | None = None

    def _segment_peer_ok(self) -> bool:
        """Whether the peer runs as this user (or off this host): a peer of another local user,
        token or not, never makes this side map or remove this user's segments (issue #48).
        Told once per connection, from the kernel's socket table."""
        if self._peer_may_name is None:
            uid = self.carrier.peer_uid() if isinstance(self.carrier, FrameConnection) else None
            self._peer_may_name = uid is None or uid == os.getuid()
        return self._peer_may_name

    def _check_segment_peer(self, name: str) -> None:
        if not self._segment_peer_ok():
            raise errors.DataLossError(f"shared-memory segment {name!r} was named by a peer of another "
                                       f"local user: not mapped")

    # ---------------------------------------------------------------- writing

    @property
    def must_drain(self) -> bool:
        """True while the raw socket's send buffer is full (never on the gRPC stream)."""
        return self.writes_nowait and self.carrier.must_drain

    def write_nowait(self, frame: Any) -> None:
        """Queue ``frame`` at once (raw socket only; UnavailableError once it is closed)."""
        self.carrier.write_nowait(frame)

    def write_serialized_nowait(self, data: bytes) -> None:
        """:meth:`write_nowait` of a frame already serialized (raw socket only)."""
        self.carrier.write_serialized_nowait(data)

    async def write(self, frame: Any) -> None:
        """Send one frame, in order with every other write on this connection."""
        carrier = self.carrier
        if self.writes_nowait:  # buffered in call order; wait only when the buffer is full
            carrier.write_nowait(frame)
            if carrier.must_drain:
                await carrier.drain()
            return
        async with self._lock:
            await carrier.write(frame)

    def takes_bulk(self, nbytes: int) -> bool:
        """Whether a payload of ``nbytes`` goes as one bulk frame (raw socket, large payload):
        its bytes leave from their own memory and land in their final buffer."""
        return self.writes_nowait and nbytes >= BULK_MIN_BYTES

    def copies_on_send(self, nbytes: int) -> bool:
        """Whether a snapshot of a payload of ``nbytes`` can be copied while it is sent (a bulk
        frame on plain TCP, :mod:`podium.transport.copyonsend`)."""
        return self.takes_bulk(nbytes) and self.carrier.writer.sends_while_copying

    def write_bulk_nowait(self, frame: Any, segments: Iterable[memoryview], nbytes: int,
                          on_sent: Callable[[], None] | None = None, copying: Any = None) -> None:
        """Queue ``frame`` (header, ``last``, no data) followed by the payload ``segments``
        as one bulk frame (raw socket only; see :meth:`takes_bulk`). The segments are read
        from their memory as the socket takes them; ``on_sent()`` runs (on the loop) once
        they are not read any more (:meth:`FrameConnection.write_bulk`). ``copying``: the
        :class:`~podium.transport.copyonsend.CopyOnSend` still copying their buffers."""
        self.carrier.write_bulk(frame.SerializeToString(), segments, nbytes, on_sent, copying)

    def abort_threadsafe(self, reason: BaseException) -> None:
        """Close the raw socket at once from any thread (bytes still queued are dropped)."""
        if self.writes_nowait:
            self._loop.call_soon_threadsafe(self.carrier.abort, reason)

    async def send_bulk(self, frame: Any, segments: Iterable[memoryview], nbytes: int) -> None:
        """:meth:`write_bulk_nowait`, then wait while the socket's buffer is full."""
        self.write_bulk_nowait(frame, segments, nbytes)
        if self.carrier.must_drain:
            await self.carrier.drain()

    def send_quietly(self, frame: Any) -> None:
        """Send a bookkeeping frame (on the loop); lost with a broken connection, as its pool is."""
        if self.closed:
            return
        if self.writes_nowait:
            try:
                self.carrier.write_nowait(frame)
            except errors.PodiumError:
                pass
        else:
            self._loop.create_task(self._write_quietly(frame))

    async def _write_quietly(self, frame: Any) -> None:
        try:
            await self.write(frame)
        except Exception:  # noqa: BLE001 - the stream broke: the pool goes with it
            pass

    async def send_chunks(self, call_id: int, header: Any, pieces: Iterable[bytes],
                          stop: Callable[[], bool] | None = None) -> bool:
        """Send a payload as frames: ``header`` on the first, ``last`` on the final one.

        ``pieces`` yields at least one chunk. Returns False when ``stop()`` said to give up
        between two frames (the call already failed or timed out), True when all were sent.
        """
        make = self._make_frame
        it = iter(pieces)
        chunk = next(it)
        first = header
        for following in it:
            if stop is not None and stop():
                return False
            await self.write(make(call_id=call_id, header=first, data=chunk))
            first, chunk = None, following
        await self.write(make(call_id=call_id, header=first, data=chunk, last=True))
        return True

    # ---------------------------------------------------------------- reading

    async def frames(self) -> AsyncIterator[Any]:
        """The frames the peer sends, until it ends the connection."""
        read = self.carrier.read
        while True:
            frame = await read()
            if frame is grpc.aio.EOF:
                return
            yield frame

    def on_bookkeeping(self, frame: Any) -> None:
        """Apply a received frame's segment bookkeeping (``shm_released``, ``shm_forget``)."""
        if self.segments is not None and (frame.shm_released or frame.shm_forget):
            self.segments.on_frame(frame)

    # ---------------------------------------------------------------- shared memory

    def write_segment(self, segments: list, nbytes: int, pin: bool = False) -> tuple[str, bool]:
        """Put a payload in shared memory for the peer: ``(name, pooled)``, or ``("", False)``
        when it must go over TCP (/dev/shm full or missing). Safe on any thread.

        ``pin``: a pooled segment stays out of reuse until :meth:`unpin_segment` (a call's
        argument, whose reply may view it: see :meth:`reply_views`)."""
        try:
            if self.segments is not None:
                name = self.segments.pool.write(segments, nbytes, pin=pin)
                if name:
                    return name, True
            return shm.write_segments(segments)[0], False
        except OSError as exc:
            log.warning("shared memory unavailable (%s); sending over TCP", exc)
            return "", False

    def read_segment(self, name: str, pooled: bool, nbytes: int, max_size: int) -> memoryview:
        """The payload the peer put in segment ``name`` (mapped, not copied)."""
        self._check_segment_peer(name)
        if pooled:
            if self.segments is None:
                raise errors.DataLossError(f"the peer sent pooled segment {name!r} on a connection "
                                           "without shared memory")
            return self.segments.cache.read(name, nbytes, max_size)
        return shm.read_segment(name, max_size=max_size)

    def unpin_segment(self, name: str) -> None:
        """The call that pinned pooled segment ``name`` is over."""
        if self.segments is not None:
            self.segments.pool.unpin(name)

    def reply_views(self, name: str, refs: Any) -> dict[int, memoryview]:
        """The buffers a reply left in this side's segment ``name`` (written in place by the
        peer): ``refs`` is the flat (index, offset, length) triples of ``ReplyHeader.refs``."""
        if self.segments is None:
            raise errors.DataLossError(f"a reply refers to segment {name!r} on a connection "
                                       "without shared memory")
        return self.segments.reply_views(name, refs)

    def read_refs(self, name: str, refs: Any, max_size: int) -> dict[int, memoryview]:
        """The buffers a call left in the peer's staged segment ``name`` (mapped, not copied,
        not unlinked: other workers map it too), by buffer index."""
        self._check_segment_peer(name)
        if self.segments is None:
            raise errors.DataLossError(f"the peer sent staged segment {name!r} on a connection "
                                       "without shared memory")
        return self.segments.cache.read_refs(name, refs, max_size)

    def drop_segment(self, name: str, pooled: bool) -> None:
        """A segment this side wrote for a call that failed: never written again, never leaked.

        A one-shot segment is unlinked by the peer when it maps it, so this is a no-op after a
        normal call; after a failed one it keeps a dead peer's input from leaking."""
        if pooled and self.segments is not None:
            self.segments.pool.abandon(name)
        else:
            shm.remove_segment(name)

    def discard_segment(self, name: str, pooled: bool, nbytes: int) -> None:
        """A segment the peer wrote that nobody will read (its call went away): a one-shot one is
        removed; a pooled one is mapped and let go at once, which gives it back to the peer."""
        if not self._segment_peer_ok():
            return  # nothing of a peer of another user's is touched
        if not pooled:
            shm.remove_segment(name)
            return
        try:
            self.read_segment(name, True, nbytes, 1 << 40)
        except errors.PodiumError:
            pass

    # ---------------------------------------------------------------- end

    def close(self, *, carrier: bool = True) -> None:
        """End the connection: drop the segments and (with ``carrier``) close the socket or
        cancel the stream. A server leaves its stream to gRPC (``carrier=False``)."""
        self.closed = True
        if self.segments is not None:
            self.segments.close()
        if not carrier:
            return
        if self.writes_nowait:
            self.carrier.close()
        else:
            cancel = getattr(self.carrier, "cancel", None)
            if cancel is not None:
                cancel()
