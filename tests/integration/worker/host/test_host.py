"""The worker host in-process: a real grpc.aio server on port 0 and a real WorkerClient."""

from __future__ import annotations

import asyncio
import threading

import cloudpickle
import pytest
import torch

from podium import codec, errors
from podium.v1 import worker_pb2, worker_pb2_grpc
from podium.worker.host import runtime
from podium.worker.caller.client import prepare

from tests.support.hostkit import Echo, hosted
from tests.support.waiting import eventually_async


def test_construct_call_and_describe(token, arun):
    async def scenario():
        async with hosted(token) as (host, client):
            assert await client.call("add", (2, 3)) == 5
            info = await client.describe()
            assert (info.worker_id, info.rank, info.world_size, info.constructed) == ("w-echo", 2, 4, True)
            assert info.class_name.endswith("Echo")
            methods = {m.name: m for m in info.methods}
            assert methods["scored"].registered and methods["scored"].dispatch_mode == "DP_COMPUTE_PROTO"
            assert methods["async_add"].is_async and not methods["add"].registered
            custom = cloudpickle.loads(methods["custom"].dispatch_payload)
            assert methods["custom"].dispatch_mode == "CUSTOM" and custom["dispatch_fn"] is len
    arun(scenario())


def test_construct_by_import_path(token, arun):
    async def scenario():
        async with hosted(token, construct=False) as (_, client):
            await client.construct(("collections:OrderedDict", (), {"a": 1}))
            assert await client.call("keys") is not None
            assert await client.call("get", ("a",)) == 1
            with pytest.raises(errors.FailedPreconditionError, match="once"):
                await client.construct(("collections:OrderedDict", (), {}))
    arun(scenario())


def _init_thread(obj):
    return obj.init_thread


def _tag_and_thread(obj, suffix):
    return obj.tag + suffix, threading.get_ident()


async def _async_tag(obj, suffix):
    return obj.tag + suffix


def test_ray_call_escape_hatch_runs_a_function_on_the_object(token, arun):
    async def scenario():
        async with hosted(token) as (_, client):
            text, thread = await client.call("__ray_call__", (_tag_and_thread, "!"))
            assert text == "t!" and thread == await client.call("thread_id")
            assert await client.call("__ray_call__", (_async_tag, "?")) == "t?"
    arun(scenario())


def test_a_call_with_no_construct_coming_is_a_precondition_error(token, arun, monkeypatch):
    monkeypatch.setattr(runtime, "CONSTRUCT_WAIT", 0.2)  # (60 s by default)
    async def scenario():
        async with hosted(token, construct=False) as (_, client):
            with pytest.raises(errors.FailedPreconditionError, match="CONSTRUCT"):
                await client.call("echo", (1,))
    arun(scenario())


def test_a_call_that_comes_before_the_construct_runs_after_it(token, arun):
    """A handle passed to another process may call before the owner's CONSTRUCT is here."""
    async def scenario():
        async with hosted(token, construct=False) as (host, client):
            early = [asyncio.ensure_future(client.call("echo", (i,))) for i in range(3)]
            await eventually_async(lambda: host.runtime.waiting_for_construct == 3, "the early calls waiting")
            assert not any(f.done() for f in early)
            await client.construct((Echo, (), {"tag": "t"}))
            assert await asyncio.gather(*early) == [0, 1, 2]
    arun(scenario())


class _FailsToBuild:
    def __init__(self):
        self._load()

    def _load(self):
        raise RuntimeError("Found no NVIDIA driver")


def test_a_call_after_a_failed_constructor_names_where_it_failed(token, arun):
    async def scenario():
        async with hosted(token, construct=False) as (_, client):
            with pytest.raises(errors.RemoteError, match="NVIDIA"):
                await client.construct((_FailsToBuild, (), {}))
            with pytest.raises(errors.FailedPreconditionError, match="constructor failed") as err:
                await client.call("echo", (1,))
            # Not only the message: the frame that raised, as the constructor's own error has it.
            assert "in _load" in str(err.value) and "RuntimeError: Found no NVIDIA driver" in str(err.value)
    arun(scenario())


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_100_mib_tensor_round_trip_is_bit_exact(token, arun, transport):
    generator = torch.Generator().manual_seed(7)
    tensor = torch.randint(0, 256, (100 * 1024 * 1024,), dtype=torch.uint8, generator=generator)
    strided = torch.randn(3072, 6144, generator=generator).t()  # 72 MiB, not contiguous

    async def scenario():
        async with hosted(token, tcp_only=transport == "tcp") as (_, client):
            assert client.same_host is (transport == "shm")
            back = await client.call("echo", (tensor,))
            assert back.dtype == tensor.dtype and torch.equal(back, tensor)
            del back
            back = await client.call("echo", (strided,))
            assert back.shape == strided.shape and torch.equal(back, strided)
    arun(scenario(), timeout=240)


@pytest.mark.parametrize("method, args, error, checks", [
    ("fail", ("no such key",), errors.RemoteError,
     {"remote_type": "KeyError", "in_traceback": "in fail", "message": "no such key"}),
    ("async_fail", (), errors.RemoteError,
     {"remote_type": "RuntimeError", "in_traceback": "in async_fail", "message": "async boom"}),
    # The call does not fit the signature: the caller's error (also a TypeError, as in Ray).
    ("add", (1,), errors.ArgumentMismatchError, {"message": "Echo.add(a, b): missing a required argument: 'b'"}),
    ("add", (1, 2, 3), errors.ArgumentMismatchError, {"message": "too many positional arguments"}),
    # A TypeError raised inside the method is still the method's own RemoteError.
    ("add", (1, "x"), errors.RemoteError, {"remote_type": "TypeError", "in_traceback": "in add",
                                           "message": "unsupported operand"}),
    ("ad", (1, 2), errors.UnknownMethodError, {"message": "did you mean add"}),
    ("__init__", (), errors.UnknownMethodError, {"message": "__init__"}),
    ("tag", (), errors.UnknownMethodError, {"message": "'tag'"}),
])
def test_errors_reach_the_caller_and_the_worker_keeps_serving(token, arun, method, args, error, checks):
    async def scenario():
        async with hosted(token) as (_, client):
            with pytest.raises(error) as caught:
                await client.call(method, args)
            exc = caught.value
            assert exc.rank == 2
            assert checks["message"] in exc.message
            if "remote_type" in checks:
                assert exc.remote_type == checks["remote_type"]
                assert "Traceback" in exc.traceback
            if "in_traceback" in checks:
                assert checks["in_traceback"] in exc.traceback
            assert await client.call("add", (1, 1)) == 2
    arun(scenario())


def test_async_method_runs_on_the_loop(token, arun):
    async def scenario():
        async with hosted(token) as (_, client):
            total, thread = await client.call("async_add", (4, 5))
            assert total == 9
            assert thread == threading.get_ident()  # in-process: the test's loop thread
            assert thread != await client.call("thread_id")
    arun(scenario())


def test_sync_methods_run_on_one_thread_in_arrival_order(token, arun):
    async def scenario():
        async with hosted(token) as (_, client):
            names = [f"c{i}" for i in range(20)]
            calls = [client.call("record", (name,)) for name in names]
            calls += [client.call("thread_id") for _ in range(5)]
            results = await asyncio.gather(*calls)
            assert results[:20] == list(range(1, 21))
            assert len(set(results[20:])) == 1 and results[20] != threading.get_ident()
            # The constructor ran on the same execution thread.
            assert await client.call("__ray_call__", (_init_thread,)) == results[20]
            assert await client.call("history") == names
    arun(scenario())


def test_replies_interleave_by_completion(token, arun):
    async def scenario():
        async with hosted(token) as (_, client):
            slow = asyncio.ensure_future(client.call("async_wait", (3.0,)))
            assert await client.call("add", (1, 2)) == 3
            assert not slow.done()
            assert await slow == "waited"
    arun(scenario())


def test_large_replies_interleave_and_are_demultiplexed(token, arun):
    async def scenario():
        async with hosted(token, tcp_only=True) as (_, client):
            # Several multi-chunk replies written at once: their frames interleave on the stream.
            values = [torch.full((3 * 1024 * 1024,), float(i)) for i in range(3)]
            results = await asyncio.gather(*(client.call("async_echo", (v, 0.05)) for v in values))
            for value, result in zip(values, results):
                assert torch.equal(value, result)
    arun(scenario())


def test_timeout_names_method_and_rank_and_cancels_unstarted_call(token, arun, tmp_path):
    async def scenario():
        async with hosted(token) as (_, client):
            marker = tmp_path / "blocker-started"
            blocker = asyncio.ensure_future(client.call("sleep_marked", (2.0, "blocker", str(marker))))
            await eventually_async(marker.exists, "the blocker to start")
            with pytest.raises(errors.DeadlineExceededError) as caught:
                await client.call("sleep", (0, "late"), timeout=0.3)
            assert "'sleep'" in str(caught.value) and "rank 2" in str(caught.value)
            assert await blocker == "blocker"
            # The timed-out call was dropped before it started.
            assert await client.call("history") == ["blocker"]
    arun(scenario())


def test_payload_over_the_maximum_is_refused_before_reading(token, arun):
    async def scenario():
        async with hosted(token, env={"PODIUM_MAX_PAYLOAD_BYTES": "65536"}, tcp_only=True) as (_, client):
            with pytest.raises(errors.PayloadTooLargeError, match="65536"):
                await client.call("echo", (b"x" * 1_000_000,))
            assert await client.call("echo", (b"small",)) == b"small"
    arun(scenario())


def test_garbage_call_frame_gets_data_loss_and_the_stream_keeps_serving(token, arun):
    async def scenario():
        async with hosted(token) as (host, client):
            # A raw stream, so the test controls every byte of the frame.
            from podium import rpc

            channel = rpc.make_channel(host.address, token)
            stream = worker_pb2_grpc.WorkerStub(channel).Calls()
            garbage = b"\x00garbage, not a payload\xff" * 3
            await stream.write(worker_pb2.CallFrame(call_id=1, header=worker_pb2.CallHeader(
                kind=worker_pb2.CALL, method="echo", payload_size=len(garbage)), data=garbage, last=True))
            reply = await asyncio.wait_for(stream.read(), 10)
            assert reply.call_id == 1 and not reply.header.ok
            assert reply.header.error.type == "DataLossError"
            assert "not a Podium payload" in reply.header.error.message
            good = b"".join(codec.encode(((1, 2), {})).to_segments())
            await stream.write(worker_pb2.CallFrame(call_id=2, header=worker_pb2.CallHeader(
                kind=worker_pb2.CALL, method="add", payload_size=len(good)), data=good, last=True))
            reply = await asyncio.wait_for(stream.read(), 10)
            assert reply.call_id == 2 and reply.header.ok
            assert codec.decode(reply.data) == 3
            # Data for a call that never had a header is refused, not guessed at.
            await stream.write(worker_pb2.CallFrame(call_id=9, data=b"abc", last=True))
            reply = await asyncio.wait_for(stream.read(), 10)
            assert reply.call_id == 9 and reply.header.error.type == "DataLossError"
            stream.cancel()
            await channel.close()
            assert await client.call("add", (2, 2)) == 4
    arun(scenario())


@pytest.mark.parametrize("elements", [10, 3 * 1024 * 1024])  # one chunk, several chunks
def test_one_payload_encoded_once_serves_several_workers(token, arun, elements):
    async def scenario():
        async with hosted(token, tcp_only=True) as (_, a), hosted(token, tcp_only=True) as (_, b):
            expected = torch.arange(elements)
            payload = prepare(((expected,), {}))
            first = await a.call_encoded("echo", payload)
            second = await b.call_encoded("echo", payload)
            assert torch.equal(first, expected) and torch.equal(second, expected)
    arun(scenario())


def test_construct_from_class_with_init_args(token, arun):
    from podium.worker.factory import ClassWithInitArgs

    async def scenario():
        async with hosted(token, construct=False) as (_, client):
            await client.construct(ClassWithInitArgs(Echo, tag="cwia"))
            assert await client.call("add", ("a", "b")) == "ab"
    arun(scenario())
