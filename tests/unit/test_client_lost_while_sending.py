"""A call whose connection is lost while it is still being sent raises that error once, and
leaves no "Future exception was never retrieved" behind (seen in the faults soak)."""

import asyncio
import gc

import pytest

from podium import errors
from podium.worker.client import WorkerClient, prepare


def test_connection_lost_during_send_raises_once_and_leaves_nothing_unretrieved():
    async def scenario():
        loop = asyncio.get_running_loop()
        unhandled = []
        loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
        client = WorkerClient("127.0.0.1:1", "token", rank=3)
        client._loop = loop
        client._stream = object()  # "started" on the gRPC stream path; no socket is used
        lost = errors.UnavailableError("lost the call connection to worker rank 3", rank=3)

        async def write(frame):
            client._fail_all(lost)  # the reader saw the connection go while this was sending
            raise lost

        client._write = write
        with pytest.raises(errors.UnavailableError) as info:
            await client._roundtrip(1, "m", prepare(((), {})), False, 5.0)
        assert info.value is lost and client.pending == 0
        del info, write, client  # the traceback's frames hold the call's future
        lost.__traceback__ = None
        gc.collect()
        await asyncio.sleep(0)
        return unhandled

    assert asyncio.run(scenario()) == []
