"""Worker hosts as real processes, started the way the node agent starts them:
``python -m podium.worker.host --ready-fd N`` with the worker environment."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from podium import errors, rpc
from podium.v1 import worker_pb2, worker_pb2_grpc
from podium.worker.caller.client import WorkerClient

from tests.support.processes import spawn_worker
from tests.support.waiting import eventually_async


@pytest.fixture
def worker(tmp_path, token):
    """One worker process, rank 0."""
    proc = spawn_worker(tmp_path, token)
    yield proc
    proc.stop()


class Counter:
    """Defined in a test module: the worker process cannot import it, so it travels by value."""

    def __init__(self, start: int) -> None:
        self.value = start

    def add(self, n: int) -> int:
        self.value += n
        return self.value

    def pid(self) -> int:
        return os.getpid()

    def env(self, name: str) -> str:
        return os.environ.get(name, "")

    def sleep(self, seconds: float, marker: str = "") -> str:
        if marker:  # the test waits for this file: the call is running in the worker
            open(marker, "w").close()
        time.sleep(seconds)
        return "slept"


def test_ready_fd_construct_by_value_and_call(worker, token, arun):
    async def scenario():
        client = WorkerClient(worker.address, token)
        info = await client.start()
        assert info.rank == 0 and info.worker_id == "w-test-0" and not info.constructed
        assert info.pid == worker.proc.pid
        await client.construct((Counter, (10,), {}))
        assert await client.call("add", (5,)) == 15
        assert await client.call("add", (), {"n": 1}) == 16
        assert await client.call("env", ("WG_BACKEND",)) == "podium"
        info = await client.describe()
        assert info.constructed and info.class_name.endswith("Counter")
        assert {m.name for m in info.methods} >= {"add", "pid", "env", "sleep"}
        await client.close()
    arun(scenario())


def test_construct_by_import_path(worker, token, arun):
    async def scenario():
        client = WorkerClient(worker.address, token)
        await client.start()
        await client.construct(("collections:Counter", ("abracadabra",), {}))
        assert await client.call("most_common", (1,)) == [("a", 5)]
        await client.close()
    arun(scenario())


def test_constructor_error_keeps_worker_up(worker, token, arun):
    async def scenario():
        client = WorkerClient(worker.address, token)
        await client.start()
        with pytest.raises(errors.RemoteError) as caught:
            await client.construct(("fractions:Fraction", ("not a number",), {}))
        assert caught.value.remote_type == "ValueError" and caught.value.rank == 0
        info = await client.describe()
        assert not info.constructed
        with pytest.raises(errors.FailedPreconditionError):
            await client.call("limit_denominator")
        await client.close()
    arun(scenario())


def test_missing_token_is_unauthenticated(worker, token):
    channel = rpc.make_sync_channel(worker.address)
    stub = worker_pb2_grpc.WorkerStub(channel)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Describe(worker_pb2.DescribeRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as caught:
        stub.Describe(worker_pb2.DescribeRequest(), timeout=10,
                      metadata=rpc.token_metadata(token + "x"))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()


def test_wrong_token_fails_the_call_stream(worker, token, arun):
    async def scenario():
        good = WorkerClient(worker.address, token)
        await good.start()  # Describe works with the right token
        bad = WorkerClient(worker.address, token + "x")
        with pytest.raises(errors.AuthenticationError):
            await bad.start()
        await good.close()
        await bad.close()
    arun(scenario())


def test_killed_mid_call_fails_pending_calls_fast(worker, token, arun, tmp_path):
    async def scenario():
        client = WorkerClient(worker.address, token, rank=0)
        await client.start()
        await client.construct((Counter, (0,), {}))
        marker = tmp_path / "running"
        pending = [asyncio.ensure_future(client.call("sleep", (60, str(marker)))) for _ in range(3)]
        await eventually_async(marker.exists, "the first call to run in the worker")
        os.kill(worker.proc.pid, signal.SIGKILL)
        for call in pending:
            with pytest.raises(errors.UnavailableError) as caught:
                await asyncio.wait_for(call, 20)
            assert "rank 0" in str(caught.value) and worker.address in str(caught.value)
        with pytest.raises(errors.UnavailableError):
            await client.call("add", (1,))
        await client.close()
    arun(scenario())


@pytest.mark.parametrize("how", ["rpc", "sigterm", "sigterm-while-busy"])
def test_shutdown_exits_zero(worker, token, arun, how, tmp_path):
    async def scenario():
        client = WorkerClient(worker.address, token, rank=0)
        await client.start()
        await client.construct((Counter, (0,), {}))
        if how == "rpc":
            await client.channel.shutdown("test over")
        elif how == "sigterm":
            worker.proc.send_signal(signal.SIGTERM)
        else:
            # A method that would run for a minute does not keep the process alive.
            marker = tmp_path / "busy"
            busy = asyncio.ensure_future(client.call("sleep", (60, str(marker))))
            await eventually_async(marker.exists, "the call to run in the worker")
            worker.proc.send_signal(signal.SIGTERM)
            with pytest.raises(errors.UnavailableError):
                await asyncio.wait_for(busy, 30)
        await client.close()
    arun(scenario())
    assert worker.proc.wait(timeout=30) == 0, worker.log()
