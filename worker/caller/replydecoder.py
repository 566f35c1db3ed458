"""Reply frames of one call connection turned into call outcomes (the client's reading side).

A :class:`~podium.worker.caller.client.WorkerClient` hands every frame its call connection reads to
:meth:`ReplyDecoder.on_frame`: an error header, a held result's ref, a reply in a
shared-memory segment, a one-frame reply, reply chunks (assembled), or a whole bulk reply
already in its final buffer. What a call's reply is goes to the client's ``finish``; the
client decodes it (:meth:`ReplyDecoder.decode`) once the call's argument segments are let go.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from podium import codec, errors, rpc
from podium.refs import ObjectRef
from podium.transport import chunks
from podium.transport.bulkframes import BulkFrame
from podium.transport.connection import CallConnection
from podium.v1 import worker_pb2
from podium.worker.caller.channel import MAX_REPLY_BYTES
from podium.worker.caller.pendingcalls import PendingCall, PendingCalls

__all__ = ["FailedReply", "InPlaceReply", "ReplyDecoder", "ShmReply"]

#: ``finish(call_id, pending_call, value, exc)``: the client settles a call.
Finish = Callable[[int, PendingCall, Any, "BaseException | None"], None]


class InPlaceReply:
    """A reply whose large buffers the worker left in the call's argument segment: the rest
    of the payload (bytes, bulk data or a ShmReply) and views of those buffers, by index."""

    __slots__ = ("reply", "views")

    def __init__(self, reply: Any, views: dict[int, memoryview]) -> None:
        self.reply = reply
        self.views = views


class FailedReply:
    """A reply whose references could not be resolved: the call fails with ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: errors.PodiumError) -> None:
        self.error = error


class ShmReply:
    """A reply the worker wrote into a shared-memory segment (its name, pool, size)."""

    __slots__ = ("name", "nbytes", "pooled")

    def __init__(self, name: str, pooled: bool = False, nbytes: int = 0) -> None:
        self.name = name
        self.pooled = pooled
        self.nbytes = nbytes

    @classmethod
    def of(cls, header: worker_pb2.ReplyHeader) -> ShmReply:
        """The segment a reply header names."""
        return cls(header.shm_name, header.shm_pooled, header.payload_size)


class ReplyDecoder:
    """One client's reply frames to outcomes (see the module docstring). ``who()`` names the
    worker in errors; ``stats`` is the client's counters."""

    def __init__(self, pending: PendingCalls, finish: Finish, stats: dict, who: Callable[[], str]) -> None:
        self._pending = pending
        self._finish = finish
        self._stats = stats
        self._who = who
        #: The call connection the frames come on (set by the client once it has one).
        self.conn: CallConnection | None = None

    def on_frame(self, frame: worker_pb2.ReplyFrame | BulkFrame) -> None:
        """One frame from the worker (a BulkFrame: a whole reply payload)."""
        if isinstance(frame, BulkFrame):
            self._on_bulk(frame)
            return
        conn = self.conn
        assert conn is not None  # frames arrive only on a started client
        if conn.segments is not None:  # (on_bookkeeping's own check, inline: once per reply)
            conn.on_bookkeeping(frame)
        p = self._pending.get(frame.call_id)
        if p is None:  # a call that already timed out or was cancelled (or call id 0)
            if frame.HasField("header") and frame.header.shm_name:
                h = frame.header
                conn.discard_segment(h.shm_name, h.shm_pooled, h.payload_size)
            return
        if frame.HasField("header"):
            header = frame.header
            if not header.ok:
                self._finish(frame.call_id, p, None, rpc.error_from_info(header.error))
                return
            if header.HasField("ref"):
                r = header.ref
                self._finish(frame.call_id, p, ObjectRef(r.object_id, r.worker_id, r.owner_address,
                                                         r.owner_rank, r.size_bytes, r.rows,
                                                         r.inline_value or None), None)
                return
            if header.shm_name:
                self._finish(frame.call_id, p, self._with_refs(header, ShmReply.of(header)), None)
                return
            if frame.last:
                self._finish(frame.call_id, p, self._with_refs(header, frame.data), None)
                return
            try:
                p.assembler = chunks.Assembler(header.payload_size, MAX_REPLY_BYTES)
            except errors.PodiumError as exc:
                self._finish(frame.call_id, p, None, exc)
                return
        if p.assembler is None:
            self._finish(frame.call_id, p, None, errors.DataLossError(
                f"reply data for call {frame.call_id} without a header from {self._who()}"))
            return
        try:
            p.assembler.add(frame.data)
            if frame.last:
                self._finish(frame.call_id, p, p.assembler.result(), None)
        except errors.PodiumError as exc:
            self._finish(frame.call_id, p, None, exc)

    def _on_bulk(self, bulk: BulkFrame) -> None:
        # A whole reply payload, already in its final buffer (raw socket only).
        frame = bulk.message
        p = self._pending.get(frame.call_id)
        if p is None:  # timed out or cancelled meanwhile: the buffer goes back with `bulk`
            return
        if bulk.error is not None:
            self._finish(frame.call_id, p, None, bulk.error)
        elif not (frame.HasField("header") and frame.header.ok):
            self._finish(frame.call_id, p, None, errors.DataLossError(
                f"a bulk reply for call {frame.call_id} without a success header from {self._who()}"))
        else:
            self._stats["bulk_received"] += 1
            self._finish(frame.call_id, p, self._with_refs(frame.header, bulk.data), None)

    def _with_refs(self, header: worker_pb2.ReplyHeader, reply: Any) -> Any:
        # A reply that left buffers in this call's argument segment: view them now, while the
        # call still pins the segment (the views then keep it from reuse).
        if not header.refs_segment:
            return reply
        assert self.conn is not None
        try:
            return InPlaceReply(reply, self.conn.reply_views(header.refs_segment, header.refs))
        except errors.PodiumError as exc:
            return FailedReply(exc)

    def decode(self, reply: Any) -> Any:
        """The value of a call's reply (an ObjectRef stays one)."""
        if type(reply) is bytes:  # a one-frame reply: most of them
            return codec.decode(reply)
        if isinstance(reply, ObjectRef):
            return reply
        external = None
        if type(reply) is InPlaceReply:
            self._stats["in_place_received"] += 1
            reply, external = reply.reply, reply.views
        if isinstance(reply, ShmReply):
            self._stats["shm_received"] += 1
            assert self.conn is not None
            return codec.decode(self.conn.read_segment(reply.name, reply.pooled, reply.nbytes, MAX_REPLY_BYTES),
                                external)
        return codec.decode(reply, external)
