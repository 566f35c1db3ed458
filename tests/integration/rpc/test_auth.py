"""The shared gRPC layer against a real server: token on every call, errors across the wire."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from podium import errors, rpc
from podium.v1 import node_pb2, node_pb2_grpc


class _Agent(node_pb2_grpc.NodeAgentServicer):
    """A NodeAgent whose handlers raise, to see errors cross the wire intact."""

    def __init__(self):
        self.calls = 0

    @rpc.handle_errors
    async def ReservePort(self, request, context):
        self.calls += 1
        raise errors.InfeasibleError("nothing fits", node_reasons={"node-b": "4 GPUs"})

    @rpc.handle_errors
    async def GetNodeInfo(self, request, context):
        self.calls += 1
        raise RuntimeError("a bug")

    @rpc.handle_errors
    async def TailLog(self, request, context):
        self.calls += 1
        yield node_pb2.LogLine(text="first")
        raise errors.NotFoundError(f"no worker {request.worker_id!r}")


async def _serve(token):
    server, health = rpc.make_server(token)
    agent = _Agent()
    node_pb2_grpc.add_NodeAgentServicer_to_server(agent, server)
    port = rpc.bind(server, "127.0.0.1", 0)
    await rpc.start_server(server, health)
    return server, agent, f"127.0.0.1:{port}"


def test_token_required_on_every_call_and_errors_keep_their_class():
    async def scenario():
        server, agent, address = await _serve("s3cret")
        try:
            good = rpc.make_channel(address, "s3cret")
            status = await health_pb2_grpc.HealthStub(good).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING

            stub = node_pb2_grpc.NodeAgentStub(good)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ReservePort(node_pb2.ReservePortRequest(), timeout=5)
            exc = rpc.error_from_rpc(info.value)
            assert isinstance(exc, errors.InfeasibleError) and exc.node_reasons == {"node-b": "4 GPUs"}

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=5)
            assert isinstance(rpc.error_from_rpc(info.value), errors.InternalError)

            lines = []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for line in stub.TailLog(node_pb2.TailLogRequest(worker_id="w-x"), timeout=5):
                    lines.append(line.text)
            assert isinstance(rpc.error_from_rpc(info.value), errors.NotFoundError)
            served = agent.calls

            for bad in (rpc.make_channel(address, "wrong"), grpc.aio.insecure_channel(address)):
                for call in (node_pb2_grpc.NodeAgentStub(bad).ReservePort(node_pb2.ReservePortRequest(), timeout=5),
                             health_pb2_grpc.HealthStub(bad).Check(health_pb2.HealthCheckRequest(), timeout=5)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call
                    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
                    assert isinstance(rpc.error_from_rpc(info.value), errors.AuthenticationError)
                await bad.close()
            # Rejected calls never reached a handler.
            assert agent.calls == served
            await good.close()
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_bind_a_taken_port_is_a_clear_error():
    async def scenario():
        server, _ = rpc.make_server("t")
        port = rpc.bind(server, "127.0.0.1", 0)
        await server.start()
        other, _ = rpc.make_server("t")
        try:
            with pytest.raises(errors.UnavailableError, match=f"127.0.0.1:{port}"):
                rpc.bind(other, "127.0.0.1", port)
        finally:
            await server.stop(0)

    asyncio.run(scenario())
