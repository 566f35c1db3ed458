"""Call frames serialized once per payload parse exactly as the messages they stand for."""

from __future__ import annotations

import pytest

from podium.transport import frames
from podium.v1 import worker_pb2


@pytest.mark.parametrize("call_id", [1, 127, 128, 300, 16383, 16384, 2**35 + 7, 2**64 - 1])
def test_frame_with_call_id_parses_as_the_protobuf_message(call_id):
    data = b"\x80\x05N."  # the pickled None
    tail = frames.call_frame_tail(worker_pb2.CALL, "noop", data, hold=True, timeout=3600.0,
                                      reply_in_shm=True)
    frame = worker_pb2.CallFrame.FromString(frames.frame_with_call_id(call_id, tail))
    expected = worker_pb2.CallFrame(call_id=call_id, data=data, last=True, header=worker_pb2.CallHeader(
        kind=worker_pb2.CALL, method="noop", payload_size=len(data), hold_result=True,
        timeout_seconds=3600.0, reply_in_shm=True))
    assert frame == expected


def test_varint_matches_protobuf():
    for value in (0, 1, 127, 128, 255, 300, 2**21, 2**63):
        assert worker_pb2.CallFrame(call_id=value).SerializeToString() == (
            b"\x08" + frames.encode_varint(value) if value else b"")


def test_a_payload_keeps_one_tail_per_header_and_none_when_large():
    from podium.transport.payload import Payload, prepare

    small = prepare(((), {}))
    first = small.frame_tail("a", True, 10.0, False)
    assert small.frame_tail("a", True, 10.0, False) is first
    assert small.frame_tail("b", True, 10.0, False) != first
    assert small.frame_tail("a", False, 10.0, False) != first
    big = prepare(((b"x" * (frames.TAIL_MAX_BYTES + 1),), {}))
    big.frame_tail("a", True, 10.0, False)
    assert big._tails is None
    once = Payload(prepare(((), {})).encoded, reusable=False)
    once.frame_tail("a", True, 10.0, False)
    assert once._tails is None
