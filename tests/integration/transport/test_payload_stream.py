"""A payload far above gRPC's default 4 MiB message limit crosses a real grpc.aio
stream in DataChunk frames (podium.transport.chunks) with default channel options, and
arrives bit-exact (podium.codec)."""

from __future__ import annotations

import asyncio

import grpc
import torch

from podium import codec
from podium.transport import chunks
from podium.v1 import worker_pb2

_METHOD = "/podium.test.PayloadEcho/Echo"
_MAX = 1 << 30


async def _receive(stream) -> object:
    assembler = None
    async for chunk in stream:
        if assembler is None:
            assembler = chunks.Assembler(chunk.total_size, max_size=_MAX)
        assembler.add(chunk.data)
    return codec.decode(assembler.result())


def _frames(value):
    encoded = codec.encode(value)
    first = True
    for chunk in chunks.iter_chunks(encoded.to_segments()):
        yield worker_pb2.DataChunk(total_size=encoded.nbytes if first else 0, data=bytes(chunk))
        first = False


async def _echo(request_iterator, context):
    # Doubles every tensor it receives so the reply cannot be a stale buffer.
    value = await _receive(request_iterator)
    for frame in _frames({k: v * 2 for k, v in value.items()}):
        yield frame


async def _round_trip(value):
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        _echo, request_deserializer=worker_pb2.DataChunk.FromString,
        response_serializer=worker_pb2.DataChunk.SerializeToString)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "podium.test.PayloadEcho", {"Echo": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(_METHOD, request_serializer=worker_pb2.DataChunk.SerializeToString,
                                         response_deserializer=worker_pb2.DataChunk.FromString)
            stream = call(iter(_frames(value)), timeout=120)
            return await _receive(stream)
    finally:
        await server.stop(grace=None)


def test_large_payload_crosses_a_default_grpc_stream():
    value = {"f32": torch.randn(3 * 1024 * 1024), "bf16": torch.randn(1000, 7).to(torch.bfloat16),
             "i64": torch.arange(5)}
    got = asyncio.run(asyncio.wait_for(_round_trip(value), timeout=180))
    for key, tensor in value.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor * 2), key
