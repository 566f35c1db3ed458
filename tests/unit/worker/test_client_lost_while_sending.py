"""A call whose connection is lost while it is still being sent raises that error once, and
leaves no "Future exception was never retrieved" behind (seen in the faults soak)."""

import asyncio
import gc

import pytest

from podium import errors
from podium.transport.connection import CallConnection
from podium.v1 import worker_pb2
from podium.worker.caller.client import WorkerClient, prepare


class LosingCarrier:
    """A gRPC-stream-like carrier whose write sees the connection go (as the reader did)."""

    def __init__(self, client: WorkerClient, lost: errors.PodiumError) -> None:
        self.client, self.lost = client, lost

    async def write(self, frame) -> None:
        self.client.fail_pending(self.lost)  # the reader saw the connection go while this was sending
        raise self.lost


def test_connection_lost_during_send_raises_once_and_leaves_nothing_unretrieved():
    async def scenario():
        loop = asyncio.get_running_loop()
        unhandled = []
        loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
        client = WorkerClient("127.0.0.1:1", "token", rank=3)
        lost = errors.UnavailableError("lost the call connection to worker rank 3", rank=3)
        # "Started" on the gRPC stream path with a carrier that loses the connection; no socket.
        client._loop = loop
        client._conn = CallConnection(LosingCarrier(client, lost), worker_pb2.CallFrame, shared_memory=False)
        with pytest.raises(errors.UnavailableError) as info:
            await client.call_encoded("m", prepare(((), {})), timeout=5.0)
        assert info.value is lost and client.pending == 0
        del info, client  # the traceback's frames hold the call's future
        lost.__traceback__ = None
        gc.collect()
        await asyncio.sleep(0)
        return unhandled

    assert asyncio.run(scenario()) == []
