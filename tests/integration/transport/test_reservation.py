"""Issue #14, item 9: a call header announcing a huge payload holds only the bytes that
arrived, within the connection's budget, and they go as soon as the client disconnects."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

import pytest

from podium import codec, errors, rpc
from podium.transport.chunks import GrowingAssembler, ReservationBudget
from podium.v1 import worker_pb2, worker_pb2_grpc
from tests.support.hostkit import hosted

pytestmark = pytest.mark.faults

ANNOUNCED = 256 << 20
MIB = 1 << 20


def test_the_assembler_holds_what_arrived_and_the_budget_bounds_it():
    budget = ReservationBudget(limit=10)
    first = GrowingAssembler(1 << 40, 1 << 41, budget)
    first.add(b"x" * 6)
    assert (first.received, budget.held) == (6, 6)
    second = GrowingAssembler(8, 100, budget)
    with pytest.raises(errors.ResourceExhaustedError, match="limit of 10"):
        second.add(b"y" * 5)
    assert budget.held == 6
    first.close()
    assert budget.held == 0
    second.add(b"y" * 8)
    assert bytes(second.result()) == b"y" * 8 and budget.held == 0
    with pytest.raises(errors.DataLossError):
        GrowingAssembler(4, 100, budget).add(b"z" * 5)


def test_a_huge_announcement_holds_one_byte_and_is_freed_on_disconnect(token, arun):
    async def scenario():
        async with hosted(token) as (host, client):
            gc.collect()
            gc.disable()  # what is freed must be freed without a collection
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                channel = rpc.make_channel(host.address, token)
                stream = worker_pb2_grpc.WorkerStub(channel).Calls()
                header = worker_pb2.CallHeader(kind=worker_pb2.CALL, method="echo", payload_size=ANNOUNCED)
                await stream.write(worker_pb2.CallFrame(call_id=1, header=header, data=b"x", last=False))
                # A complete call behind it: its answer means the first frame was taken in.
                payload = b"".join(bytes(s) for s in codec.encode(((7,), {})).to_segments())
                small = worker_pb2.CallHeader(kind=worker_pb2.CALL, method="echo", payload_size=len(payload))
                await stream.write(worker_pb2.CallFrame(call_id=2, header=small, data=payload, last=True))
                async for reply in stream:
                    if reply.call_id == 2 and reply.last:
                        break
                held = tracemalloc.get_traced_memory()[0] - base
                print(f"\nannounced {ANNOUNCED >> 20} MiB, sent 1 byte: {held / MIB:.2f} MiB more held")
                assert held < 16 * MIB
                stream.cancel()
                await channel.close()
                for _ in range(200):
                    after = tracemalloc.get_traced_memory()[0] - base
                    if after < 8 * MIB:
                        break
                    await asyncio.sleep(0.05)
                assert after < 8 * MIB
                assert await client.call("add", (2, 3)) == 5
            finally:
                tracemalloc.stop()
                gc.enable()
    arun(scenario())
