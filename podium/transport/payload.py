"""A call's encoded arguments, prepared once and sendable to many workers.

The controller's fan-out sends one shard to several ranks (a ONE_TO_ALL call sends the same
arguments to all of them): :class:`Payload` encodes it once, makes its chunk ``bytes`` once,
and keeps the serialized one-frame CALL (minus the call id, see :mod:`podium.transport.frames`)
for the next call with the same options.
"""

from __future__ import annotations

import weakref
from typing import Any

from podium import codec
from podium.memorypool import MIN_POOLED_BYTES
from podium.transport import chunks, frames, shm
from podium.transport.copyonsend import CopyOnSend
from podium.v1 import worker_pb2

__all__ = ["Payload", "Written", "prepare", "shares_shm"]

_CALL = frames.CALL


class Payload:
    """An encoded call payload, prepared once and sendable to many workers.

    With ``reusable`` (what :func:`prepare` makes) the chunk ``bytes`` are made
    on first use and kept for every later worker, so a shard several ranks
    receive is encoded and copied once. A one-shot payload streams its chunks
    instead, so a huge argument is never held twice.
    """

    __slots__ = ("_chunks", "_tails", "copying", "encoded", "nbytes", "reusable", "staged", "written")

    def __init__(self, encoded: codec.Encoded, reusable: bool = True) -> None:
        self.encoded = encoded
        self.nbytes = encoded.nbytes
        self.reusable = reusable
        #: Already copied into one worker's shared-memory segment (a :class:`Written`), or None.
        self.written: Written | None = None
        #: Its large buffers copied into a group call's staged segment, for same-host workers
        #: (a :class:`podium.transport.shmstage.Staged`), or None.
        self.staged: Any = None
        #: Its buffers still being copied while it is sent (a
        #: :class:`podium.transport.copyonsend.CopyOnSend`), or None.
        self.copying: Any = None
        self._chunks: list[bytes] | None = None
        self._tails: dict | None = None

    def snapshot(self) -> "Payload":
        """This payload with its buffers copied (:meth:`podium.codec.Encoded.snapshot`): what
        a call that returns before it is sent sends, so later changes to the caller's
        tensors do not reach the workers."""
        encoded = self.encoded.snapshot()
        return self if encoded is self.encoded else Payload(encoded, self.reusable)

    def snapshot_while_sent(self, loop: Any) -> "Payload":
        """:meth:`snapshot`, copied while a bulk frame on plain TCP sends it from ``loop``
        (:mod:`podium.transport.copyonsend`): the copy is made by ``copying.run()``, which the
        caller runs once the call is queued, before it returns. Small buffers are copied now."""
        encoded = self.encoded
        if sum(buf.nbytes for buf in encoded.buffers) < MIN_POOLED_BYTES:
            return self.snapshot()
        target = encoded.pooled_target()
        snapshot = Payload(target, self.reusable)
        snapshot.copying = CopyOnSend(loop, encoded.buffers, target.buffers)
        return snapshot

    def frame_tail(self, method: str, hold: bool, timeout: float, reply_in_shm: bool) -> bytes:
        """The serialized one-frame CALL of this payload minus its call id (see
        :mod:`podium.transport.frames`); kept for the next call with the same options."""
        key = (method, hold, timeout, reply_in_shm)
        tails = self._tails
        if tails is not None:
            tail = tails.get(key)
            if tail is not None:
                return tail
        first = next(iter(self.iter_chunks()))
        tail = frames.call_frame_tail(_CALL, method, first, hold=hold, timeout=timeout,
                                      reply_in_shm=reply_in_shm)
        if self.reusable and self.nbytes <= frames.TAIL_MAX_BYTES:
            if tails is None:
                tails = self._tails = {}
            if len(tails) < frames.MAX_TAILS:
                tails[key] = tail
        return tail

    def iter_chunks(self):
        """The wire form as chunk-sized ``bytes`` (at least one, the last one marked by the caller)."""
        if self._chunks is not None:
            return self._chunks
        segments = self.encoded.to_segments()
        if self.nbytes <= chunks.CHUNK_SIZE:
            self._chunks = [b"".join(segments)]
            return self._chunks
        if self.reusable:
            self._chunks = [bytes(chunk) for chunk in chunks.iter_chunks(segments)]
            return self._chunks
        return (bytes(chunk) for chunk in chunks.iter_chunks(segments))

    def segments(self) -> list[memoryview]:
        """The wire form as zero-copy segments (for shared memory)."""
        return self.encoded.to_segments()


class Written:
    """A payload copied into a shared-memory segment of one connection before its call is sent.

    A call that returns before it is sent must send its arguments as they were (see
    :meth:`Payload.snapshot`); for a worker that reads them from shared memory, writing the
    segment at once *is* that snapshot, with no second copy. The segment is the call's from
    :meth:`take` on; one never taken (the call never went out) is dropped when this object is.
    """

    def __init__(self, conn: Any, name: str, pooled: bool) -> None:
        self.conn = conn
        self._unsent = weakref.finalize(self, conn.drop_segment, name, pooled)

    def take(self, conn: Any) -> tuple[str, bool]:
        """``(name, pooled)`` for the call sending it on ``conn``; ``("", False)`` when it was
        written for another connection or already taken."""
        if conn is not self.conn:
            return "", False
        taken = self._unsent.detach()  # (self, drop_segment, (name, pooled), {}), or None
        return (taken[2][0], taken[2][1]) if taken is not None else ("", False)

    @staticmethod
    def payload(nbytes: int, conn: Any, name: str, pooled: bool) -> Payload:
        """A payload of ``nbytes`` whose bytes are in segment ``name`` of ``conn`` only."""
        payload = Payload(codec.Encoded(b""), reusable=False)
        payload.nbytes = nbytes
        payload.written = Written(conn, name, pooled)
        return payload


def prepare(value: Any) -> Payload:
    """Encode ``value`` once into a :class:`Payload` (for ``WorkerClient.call_encoded``)."""
    return Payload(codec.encode(value))


def shares_shm(info: worker_pb2.DescribeResponse) -> bool:
    """Whether the described worker sees this process's /dev/shm (see :func:`shm.domain`)."""
    mine = shm.domain()
    return bool(mine) and info.shm_domain == mine
