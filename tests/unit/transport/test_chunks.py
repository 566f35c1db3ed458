"""podium.transport.chunks: chunking a payload's segments and assembling them again."""

from __future__ import annotations

import pytest

from podium.transport import chunks
from podium.errors import DataLossError, PayloadTooLargeError, ResourceExhaustedError


def segments_of(*sizes: int) -> list[memoryview]:
    """Segments of the given sizes with distinct, position-dependent bytes."""
    out, start = [], 0
    for size in sizes:
        out.append(memoryview(bytes((start + i) % 251 for i in range(size))))
        start += size
    return out


CASES = {
    "nothing": ([], 10),
    "one-empty": ([0], 10),
    "one-small": ([3], 10),
    "exact-chunk": ([10], 10),
    "many-small": ([1, 2, 3, 0, 4, 5, 6], 4),
    "header-then-big": ([24, 1000, 7], 64),
    "big-multiple": ([640], 64),
    "big-between-small": ([5, 300, 5, 300], 100),
    "chunk-size-one": ([3, 4], 1),
}


@pytest.mark.parametrize("name", CASES)
def test_chunks_concatenate_to_the_payload(name):
    sizes, chunk_size = CASES[name]
    segments = segments_of(*sizes)
    pieces = list(chunks.iter_chunks(segments, chunk_size))
    assert b"".join(bytes(c) for c in pieces) == b"".join(bytes(s) for s in segments)
    assert all(len(c) == chunk_size for c in pieces[:-1])
    assert all(0 < len(c) <= chunk_size for c in pieces)


def test_spans_inside_a_segment_are_not_copied():
    big = bytearray(10_000)
    pieces = list(chunks.iter_chunks([memoryview(big)], 1000))
    assert len(pieces) == 10
    assert all(isinstance(c, memoryview) and c.obj is big for c in pieces)


def test_default_chunk_fits_a_default_grpc_message():
    assert chunks.CHUNK_SIZE <= 4 * 1024 * 1024 - 64 * 1024


def test_bad_chunk_size():
    with pytest.raises(ValueError):
        list(chunks.iter_chunks([b"abc"], 0))


@pytest.mark.parametrize("chunk_size", [1, 7, 4096, chunks.CHUNK_SIZE])
def test_assembler_rebuilds_the_payload(chunk_size):
    payload = bytes(range(256)) * 50
    assembler = chunks.Assembler(len(payload), max_size=len(payload))
    for chunk in chunks.iter_chunks([memoryview(payload)], chunk_size):
        assert not assembler.done
        assembler.add(chunk)
    assert assembler.done and assembler.received == len(payload)
    result = assembler.result()
    assert isinstance(result, bytearray) and result == payload


def test_empty_payload_is_done_at_once():
    assembler = chunks.Assembler(0, max_size=10)
    assert assembler.done and assembler.result() == bytearray()


def test_overrun_raises_data_loss():
    assembler = chunks.Assembler(5, max_size=100)
    assembler.add(b"abc")
    with pytest.raises(DataLossError, match="6 bytes arrived, 5 announced"):
        assembler.add(b"def")


def test_underrun_raises_data_loss():
    assembler = chunks.Assembler(5, max_size=100)
    assembler.add(b"abc")
    with pytest.raises(DataLossError, match="3 of 5"):
        assembler.result()


def test_oversize_announcement_is_refused_before_allocating():
    with pytest.raises(PayloadTooLargeError) as info:
        chunks.Assembler(1 << 50, max_size=1 << 20)
    assert str(1 << 50) in str(info.value) and str(1 << 20) in str(info.value)


def test_negative_announcement_raises_data_loss():
    with pytest.raises(DataLossError):
        chunks.Assembler(-1, max_size=10)


def test_unfinished_payloads_of_all_connections_together_stay_within_the_process_bound(monkeypatch):
    from podium.transport.chunks import RECEIVING, ReservationBudget

    monkeypatch.setattr(RECEIVING, "limit", 3 << 20)
    one, two = ReservationBudget(8 << 20), ReservationBudget(8 << 20)  # two connections
    first = chunks.Assembler(2 << 20, 8 << 20, one)
    second = chunks.Assembler(2 << 20, 8 << 20, two)
    first.add(b"x" * (2 << 20))
    with pytest.raises(ResourceExhaustedError, match="this process's unfinished payloads"):
        second.add(b"y" * (2 << 20))
    assert two.held == 0  # nothing counted on the connection that was refused
    first.close()
    second.add(b"y" * (2 << 20))  # room again
    assert RECEIVING.held == 2 << 20
    second.close()
    assert RECEIVING.held == 0
