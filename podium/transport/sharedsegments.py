"""The shared memory of one same-host call connection: the segments this side writes for the
peer, the peer's segments this side reads, the group calls' staged segments it was sent, and
the bookkeeping frames between the two sides.

:class:`SharedSegments` puts together a :class:`~podium.transport.shmpool.SegmentPool`, a
:class:`~podium.transport.shmpool.SegmentCache` and the process's
:class:`~podium.transport.shmstage.StagePool`; it sits above all three, so none of them
knows the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from podium.transport.shmpool import SegmentCache, SegmentPool, ref_triples
from podium.transport.shmstage import STAGE, StagePool

__all__ = ["SharedSegments"]


class SharedSegments:
    """Both halves for one call connection: the :class:`SegmentPool` this side writes and
    the :class:`SegmentCache` of the peer's segments, plus the bookkeeping frames between them.

    ``make_frame(**fields)`` builds this side's frame type (CallFrame or ReplyFrame) and
    ``send(frame)`` queues it on the connection; both run on ``loop``. Pools and caches
    call back from any thread, so their messages hop onto the loop first. ``stage`` holds
    the staged segments this connection may be sent (the process's, by default).
    """

    def __init__(self, loop: Any, make_frame: Callable[..., Any], send: Callable[[Any], None],
                 stage: StagePool = STAGE) -> None:
        self._loop = loop
        self._make_frame = make_frame
        self._send = send
        self._stage = stage
        self.closed = False
        #: What this side writes for the peer.
        self.pool = SegmentPool(lambda names: self._queue(forget=names))
        #: What the peer wrote for this side.
        self.cache = SegmentCache(lambda names: self._queue(released=names))

    def _queue(self, released: Sequence[str] = (), forget: Sequence[str] = ()) -> None:
        if self.closed:
            return
        try:
            self._loop.call_soon_threadsafe(self._write, list(released), list(forget))
        except RuntimeError:  # the loop is closed: so is the connection
            pass

    def _write(self, released: list[str], forget: list[str]) -> None:
        if not self.closed:
            # call id 0: a frame that carries only segment bookkeeping
            self._send(self._make_frame(call_id=0, shm_released=released, shm_forget=forget))

    def forget_foreign(self, names: Sequence[str]) -> None:
        """Tell the peer to forget segments this side dropped that are not the pool's (staged
        ones). Safe on any thread."""
        self._queue(forget=names)

    def reply_views(self, name: str, refs: Sequence[int]) -> dict[int, memoryview]:
        """The buffers a reply left in segment ``name`` that this side lent the peer (its
        pool's or a staged one, written in place by the peer), by buffer index: ``refs`` is
        the flat (index, offset, length) triples of ``ReplyHeader.refs``."""
        view = self.pool.view if self.pool.holds(name) else self._stage.view
        return {index: view(name, offset, length) for index, offset, length in ref_triples(refs, "a reply's")}

    def on_frame(self, frame: Any) -> None:
        """Apply a received frame's ``shm_released`` (to the pool, or to the staged segments
        for names not its own) and ``shm_forget`` (to the cache)."""
        if frame.shm_released:
            for name in self.pool.release(list(frame.shm_released)):
                self._stage.release(name, self)
        if frame.shm_forget:
            self.cache.forget(list(frame.shm_forget))

    def close(self) -> None:
        """The connection ended: drop the pool's segments and forget the peer's (and the
        staged segments the peer held are its no more)."""
        self.closed = True
        self.pool.close()
        self.cache.close()
        self._stage.link_closed(self)
