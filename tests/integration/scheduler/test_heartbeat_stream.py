"""Heartbeats on one long-lived HeartbeatStream per node, against the real scheduler over gRPC:
they renew the lease and are metered like unary ones, a bad beat fails with its error and
the next beat opens a new stream, stopping the scheduler ends open streams at once, a
scheduler that does not answer is a deadline error, and one without the stream gets unary
heartbeats."""

import asyncio

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from podium import errors, rpc
from podium.limits import MAX_REPEATED
from podium.scheduler.client import HeartbeatStream, SchedulerClient
from podium.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.support.scheduler_fakes import Cluster, node_info
from tests.support.waiting import eventually_async


def _heartbeats_counted(text: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name == "podium_scheduler_rpcs_total" and sample.labels.get("method") == "Heartbeat"
                    and sample.labels.get("code") == "OK"):
                return sample.value
    return 0.0


def test_beats_on_one_stream_keep_the_lease_and_are_metered(token, arun):
    async def scenario():
        async with Cluster(token, agents=0, node_lease=0.4, heartbeat_interval=0.1) as c:
            await c.client.register_node(node_info("n1", "127.0.0.2", 7001))
            service = c.running.service
            for _ in range(12):  # 1.2 s: three leases' worth, kept only by the beats
                reply = await c.client.heartbeat("n1", gpus=[common_pb2.GpuInfo(index=0, memory_used_bytes=7)])
                assert not reply.reregister
                await asyncio.sleep(0.1)
            assert len(service.streams) == 1  # all of them on one call
            assert service.model.nodes["n1"].state == common_pb2.NODE_ALIVE
            assert service.model.nodes["n1"].info.gpus[0].memory_used_bytes == 7
            # An unknown node is told to register, on the same stream.
            assert (await c.client.heartbeat("nobody")).reregister
            assert len(service.streams) == 1
            assert _heartbeats_counted(generate_latest(service.metrics.registry).decode()) == 13
    arun(scenario())


def test_a_bad_beat_fails_with_its_error_and_the_next_opens_a_new_stream(token, arun):
    async def scenario():
        async with Cluster(token, agents=0) as c:
            await c.client.register_node(node_info("n1", "127.0.0.2", 7001))
            await c.client.heartbeat("n1")
            too_many = [common_pb2.ProcessMemory(pid=i) for i in range(MAX_REPEATED + 1)]
            with pytest.raises(errors.InvalidArgumentError, match="processes"):
                await c.client.heartbeat("n1", processes=too_many)
            assert not (await c.client.heartbeat("n1")).reregister
            await eventually_async(lambda: len(c.running.service.streams) == 1, "the failed stream to be gone")
    arun(scenario())


def test_a_stream_without_the_token_is_refused(token, arun):
    async def scenario():
        async with Cluster(token, agents=0) as c:
            await c.client.register_node(node_info("n1", "127.0.0.2", 7001))
            async with SchedulerClient(c.running.address, "wrong-token") as intruder:
                with pytest.raises(errors.AuthenticationError):
                    await intruder.heartbeat("n1")
            assert not c.running.service.streams
    arun(scenario())


def test_stopping_the_scheduler_ends_open_streams_at_once(token, arun):
    async def scenario():
        c = Cluster(token, agents=0)
        await c.__aenter__()
        try:
            await c.client.register_node(node_info("n1", "127.0.0.2", 7001))
            await c.client.heartbeat("n1")
            assert len(c.running.service.streams) == 1
            # The stream never ends by itself: without end_streams the stop waits the whole grace.
            await asyncio.wait_for(c.running.stop(grace=30), 10)
            with pytest.raises(errors.UnavailableError, match="is stopping"):
                await c.client.heartbeat("n1")
        finally:
            await c.client.close()
    arun(scenario())


class _Silent(scheduler_pb2_grpc.SchedulerServicer):
    """Reads heartbeats on the stream and never answers."""

    async def HeartbeatStream(self, request_iterator, context):
        async for _ in request_iterator:
            pass


class _UnaryOnly(scheduler_pb2_grpc.SchedulerServicer):
    """A scheduler from before the stream: unary Heartbeat only (the stream is UNIMPLEMENTED)."""

    def __init__(self):
        self.beats = 0

    async def Heartbeat(self, request, context):
        self.beats += 1
        return scheduler_pb2.HeartbeatResponse(reregister=request.node_id != "n1")


async def _serve(servicer):
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def test_an_unanswered_beat_is_a_deadline_error_and_ends_its_call(arun):
    async def scenario():
        server, channel = await _serve(_Silent())
        try:
            beats = HeartbeatStream(scheduler_pb2_grpc.SchedulerStub(channel), timeout=0.3, what="test")
            with pytest.raises(errors.DeadlineExceededError, match="no heartbeat answer within 0.3 s"):
                await beats.beat(scheduler_pb2.HeartbeatRequest(node_id="n1"))
            assert beats._call is None  # the next beat opens a new call
            with pytest.raises(errors.DeadlineExceededError):
                await beats.beat(scheduler_pb2.HeartbeatRequest(node_id="n1"))
        finally:
            await channel.close()
            await server.stop(0)
    arun(scenario())


def test_a_scheduler_without_the_stream_gets_unary_heartbeats(arun):
    async def scenario():
        servicer = _UnaryOnly()
        server, channel = await _serve(servicer)
        try:
            beats = HeartbeatStream(scheduler_pb2_grpc.SchedulerStub(channel), timeout=5, what="test",
                                    metadata=rpc.token_metadata("t"))
            assert not (await beats.beat(scheduler_pb2.HeartbeatRequest(node_id="n1"))).reregister
            assert (await beats.beat(scheduler_pb2.HeartbeatRequest(node_id="n2"))).reregister
            assert servicer.beats == 2 and beats._unary
        finally:
            await channel.close()
            await server.stop(0)
    arun(scenario())


def test_a_silent_stream_is_ended_after_two_leases(token, arun):
    async def scenario():
        async with Cluster(token, agents=0, node_lease=0.3, heartbeat_interval=0.1) as c:
            await c.client.register_node(node_info("n1", "127.0.0.2", 7001))
            await c.client.heartbeat("n1")
            assert len(c.running.service.streams) == 1
            await asyncio.sleep(1.0)  # silent for more than two leases (0.6 s)
            assert not c.running.service.streams
            with pytest.raises(errors.DeadlineExceededError, match="no heartbeat on this stream"):
                await c.client.heartbeat("n1")
            assert (await c.client.heartbeat("n1")).reregister  # a new stream; the node died meanwhile
    arun(scenario())
