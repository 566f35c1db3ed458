"""Encode + decode cost of a 128 MiB float32 tensor through each payload path.

    python bench/codec_bench.py [MiB]

Paths: codec only (encode, then decode from one received bytearray: zero copies
of tensor bytes), chunks (iter_chunks + Assembler: the one copy of a gRPC hop,
without the sockets), and shared memory (write_segments + read_segment: one
copy). A benchmark, not a test: it asserts correctness, never a time.
"""

from __future__ import annotations

import sys
import time

import torch

from podium import codec
from podium.transport import chunks
from podium.transport import shm


def best_of(fn, repeat: int = 5) -> float:
    """Fastest wall time of ``repeat`` runs of ``fn`` (seconds)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    """Print one line per path: time and throughput (payload bytes / time)."""
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    tensor = torch.randn(mib * 1024 * 1024 // 4)
    wire = bytearray(codec.encode(tensor).nbytes)

    def received() -> bytearray:
        # What a receiver holds after the transport put the bytes in place.
        view, offset = memoryview(wire), 0
        for segment in codec.encode(tensor).to_segments():
            view[offset:offset + segment.nbytes] = segment
            offset += segment.nbytes
        return wire

    received()

    def codec_only() -> None:
        encoded = codec.encode(tensor)
        encoded.to_segments()
        out = codec.decode(wire)
        assert out.data_ptr() != tensor.data_ptr() and out.numel() == tensor.numel()

    def chunked() -> None:
        encoded = codec.encode(tensor)
        assembler = chunks.Assembler(encoded.nbytes, max_size=1 << 40)
        for chunk in chunks.iter_chunks(encoded.to_segments()):
            assembler.add(chunk)
        codec.decode(assembler.result())

    def shared_memory() -> None:
        name, _ = shm.write_segments(codec.encode(tensor).to_segments())
        codec.decode(shm.read_segment(name))

    assert torch.equal(codec.decode(received()), tensor)
    nbytes = tensor.numel() * 4
    for label, fn in (("encode+decode (no copy)", codec_only), ("chunks + Assembler", chunked),
                      ("shared memory", shared_memory)):
        seconds = best_of(fn)
        print(f"{label:26s} {mib} MiB: {seconds * 1e3:8.2f} ms  {nbytes / seconds / 1e9:8.2f} GB/s")


if __name__ == "__main__":
    main()
