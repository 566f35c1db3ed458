"""Call frames encoded once per payload: only the call id differs between the calls of a burst.

A ``blocking=False`` burst sends the same method with the same encoded arguments many
times (and a ONE_TO_ALL call sends it to every rank): building a CallHeader and a
CallFrame message and serializing them per call is most of the sender's work. The
protobuf wire form lets fields come in any order, so a frame is the ``call_id`` field
followed by the serialized rest (header, data, last), and the rest is made once per
(payload, method, options) and reused.
"""

from __future__ import annotations

import functools
import struct

from podium.v1 import worker_pb2

__all__ = ["call_frame_tail", "frame_with_call_id", "trace_suffix", "release_suffix", "encode_varint", "is_whole_call", "MAX_TAILS",
           "TAIL_MAX_BYTES", "FRAME_LENGTH", "BULK_FLAG"]

#: The raw call socket's frame prefix: a u32 length, little-endian (``podium.transport.callsocket``).
FRAME_LENGTH = struct.Struct("<I")
#: Set in a frame's length when the frame is a bulk one (its payload follows the message raw).
BULK_FLAG = 0x80000000

#: Tails a payload keeps (a payload goes out with few distinct headers).
MAX_TAILS = 16
#: Payloads larger than this are not kept twice (as chunks and as a tail): the copy
#: dominates their cost anyway.
TAIL_MAX_BYTES = 64 << 10

_CALL_ID_TAG = b"\x08"  # field 1 (call_id), wire type 0 (varint)
#: The kinds of a call's first frame (``CallHeader.kind``), named once for both ends.
CALL, CONSTRUCT, CANCEL = worker_pb2.CALL, worker_pb2.CONSTRUCT, worker_pb2.CANCEL
_CALL = CALL


_ONE_BYTE = [bytes((value,)) for value in range(0x80)]


def encode_varint(value: int) -> bytes:
    """The protobuf base-128 varint of a non-negative integer."""
    if value < 0x80:
        return _ONE_BYTE[value]
    if value < 0x4000:  # (call ids and frame lengths: the common sizes, without a loop)
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    if value < 0x200000:
        return bytes(((value & 0x7F) | 0x80, ((value >> 7) & 0x7F) | 0x80, value >> 14))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def call_frame_tail(kind: worker_pb2.CallKind.ValueType, method: str, data: bytes, *, hold: bool, timeout: float,
                    reply_in_shm: bool) -> bytes:
    """A one-frame call's CallFrame without its call id, serialized (header, data, last)."""
    header = worker_pb2.CallHeader(kind=kind, method=method, payload_size=len(data), hold_result=hold,
                                   timeout_seconds=timeout, reply_in_shm=reply_in_shm)
    return worker_pb2.CallFrame(header=header, data=data, last=True).SerializeToString()


# CallFrame.header (field 2, length-delimited) holding only CallHeader.trace_id (field 11,
# varint): appended to a serialized frame, protobuf merges it into the frame's header.
_HEADER_TAG, _TRACE_TAG = b"\x12", b"\x58"
# CallHeader.release: field 12, length-delimited.
_RELEASE_TAG = b"\x62"


@functools.lru_cache(maxsize=64)  # the ranks of a group call share its id: made once per call
def trace_suffix(trace_id: int) -> bytes:
    """Bytes that, appended to a serialized CallFrame, set its ``header.trace_id`` (protobuf
    merges a repeated embedded message): a frame tail cached for many calls stays shared."""
    inner = _TRACE_TAG + encode_varint(trace_id)
    return _HEADER_TAG + encode_varint(len(inner)) + inner


def release_suffix(object_ids: list[str]) -> bytes:
    """Bytes that, appended to a serialized CallFrame, add ``object_ids`` to its
    ``header.release`` (field 12, repeated string): the frame tail stays shared, as with
    :func:`trace_suffix`."""
    inner = b"".join(_RELEASE_TAG + encode_varint(len(raw)) + raw for raw in (i.encode() for i in object_ids))
    return _HEADER_TAG + encode_varint(len(inner)) + inner


def frame_with_call_id(call_id: int, tail: bytes) -> bytes:
    """The serialized CallFrame (or ReplyFrame: its call id is field 1 too) of call ``call_id``
    (a positive id) with ``tail`` as the rest."""
    return _CALL_ID_TAG + encode_varint(call_id) + tail


def is_whole_call(frame: worker_pb2.CallFrame, max_payload_bytes: int) -> bool:
    """Whether ``frame`` is a CALL that carries its whole payload (at most
    ``max_payload_bytes``) inline: one frame, no shared-memory segment, no staged refs, no
    segment bookkeeping. The calls a worker may start the moment their frame arrives."""
    # Each field read costs microseconds when a worker runs on caches the other processes
    # took (128 workers on 2 cores): the usual frame passes with the fewest, the kind first.
    # (CALL is not 0, so a frame without a header is no CALL.)
    header = frame.header
    return (header.kind == _CALL and frame.last and len(frame.data) == header.payload_size <= max_payload_bytes
            and not header.shm_name and not header.refs_segment and not frame.shm_released
            and not frame.shm_forget)
