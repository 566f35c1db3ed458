"""All three Podium gRPC services, real and in-process, on a background event loop.

:class:`LiveServices` starts a scheduler (in-memory state, HTTP too), a node agent
registered with it (2 fake GPUs; its workers are ``agent_fake_worker.py``, so a stray
SpawnWorkers starts a process that imports nothing) and a worker host with a
constructed :class:`Target`. Tests talk to them with blocking gRPC channels from the
test thread, which is what a foreign client looks like to the services.
"""

from __future__ import annotations

import asyncio
import pathlib
import sys
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from podium import rpc
from podium.auth import TlsConfig
from podium.scheduler.server import run_scheduler
from podium.worker.agent.service import AgentConfig, run_agent
from podium.worker.caller.client import WorkerClient
from podium.worker.host.process import start_host
from tests.support.scheduler_fakes import config as scheduler_config

from tests.support.processes import FAKE_WORKER  # noqa: E402

#: Fully qualified service names, as they appear in a method path.
SERVICES = ("podium.v1.Scheduler", "podium.v1.NodeAgent", "podium.v1.Worker")


class Target:
    """The object the worker host serves."""

    def __init__(self) -> None:
        self.calls = 0

    def add(self, a, b):
        self.calls += 1
        return a + b

    def touch(self, path):
        """Create ``path`` (what a payload that reached user code could do)."""
        pathlib.Path(path).write_text("touched")


class LiveServices:
    """Start with ``with LiveServices(token, tmp) as live:``; all stop on exit."""

    def __init__(self, token: str, workdir: pathlib.Path, *, tls: TlsConfig | None = None,
                 worker_env: dict | None = None) -> None:
        self.token = token
        self.workdir = pathlib.Path(workdir)
        self.tls = tls
        self.worker_env = dict(worker_env or {})
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="live-services", daemon=True)

    # ---- running coroutines on the services' loop

    def run(self, coro, timeout: float = 60.0):
        """Run ``coro`` on the services' loop and wait for it (with a deadline)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # ---- lifecycle

    def __enter__(self) -> "LiveServices":
        self._thread.start()
        try:
            self.run(self._start())
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    async def _start(self) -> None:
        self.scheduler = self.agent = self.host = self.client = None
        self.scheduler = await run_scheduler(scheduler_config(self.token, tls=self.tls))
        self.agent = await run_agent(AgentConfig(
            scheduler=self.scheduler.address, node_id="node-live", cpus=4, fake_gpus=2,
            log_dir=str(self.workdir / "agent-logs"), token=self.token, tls=self.tls, stop_grace=1.0,
            metrics_port=0,
            worker_command=[sys.executable, str(FAKE_WORKER)]))
        await asyncio.wait_for(self.agent.registered.wait(), 30)
        self.host = await start_host("127.0.0.1", token=self.token, tls=self.tls,
                                     env={"RANK": "0", "WORLD_SIZE": "1", "PODIUM_WORKER_ID": "w-live",
                                          **self.worker_env})
        self.client = WorkerClient(self.host.address, self.token, rank=0, tls=self.tls)
        await self.client.start()
        await self.client.construct((Target, (), {}))

    async def _stop(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.host is not None:
            await self.host.stop(grace=0.2)
        if self.agent is not None:
            await self.agent.stop(grace=0.5)
        if self.scheduler is not None:
            await self.scheduler.stop(0)

    def __exit__(self, *exc) -> None:
        try:
            if self._thread.is_alive():
                self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()

    # ---- what tests need

    @property
    def addresses(self) -> dict[str, str]:
        """Service name -> "host:port" of the process serving it."""
        return {"podium.v1.Scheduler": self.scheduler.address, "podium.v1.NodeAgent": self.agent.address,
                "podium.v1.Worker": self.host.address}

    def channel(self, service: str) -> grpc.Channel:
        """A blocking channel to the process serving ``service`` (TLS when the services use it)."""
        return rpc.make_sync_channel(self.addresses[service], self.tls)

    def metadata(self, token: str | None = "") -> tuple:
        """Call metadata with the cluster token (``token=None``: none, a string: that one)."""
        if token is None:
            return ()
        return rpc.token_metadata(token or self.token)

    def assert_serving(self) -> None:
        """Every service answers its health check and a real request, with the token."""
        from podium.v1 import node_pb2, node_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

        for service in SERVICES:
            with self.channel(service) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), metadata=self.metadata(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
                if service == "podium.v1.Scheduler":
                    state = scheduler_pb2_grpc.SchedulerStub(channel).GetClusterState(
                        scheduler_pb2.GetClusterStateRequest(), metadata=self.metadata(), timeout=10)
                    # (a generated RegisterNode that happens to be valid adds a node: that is
                    # the service working; the live node must still be there)
                    assert "node-live" in [n.info.node_id for n in state.nodes], state.nodes
                elif service == "podium.v1.NodeAgent":
                    info = node_pb2_grpc.NodeAgentStub(channel).GetNodeInfo(
                        node_pb2.GetNodeInfoRequest(), metadata=self.metadata(), timeout=10)
                    assert info.node_id == "node-live"
        assert self.run(self.client.call("add", (2, 3)), timeout=30) == 5


def method_paths(service: str) -> list[tuple[str, object]]:
    """``[("/pkg.Service/Method", MethodDescriptor), ...]`` of one Podium service."""
    from podium.v1 import node_pb2, scheduler_pb2, worker_pb2

    module = {"podium.v1.Scheduler": scheduler_pb2, "podium.v1.NodeAgent": node_pb2,
              "podium.v1.Worker": worker_pb2}[service]
    descriptor = module.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[1]]
    return [(f"/{service}/{m.name}", m) for m in descriptor.methods]


def raw_call(channel: grpc.Channel, path: str, method, payload: bytes, metadata, timeout: float = 10.0):
    """Send ``payload`` bytes as the request of ``method`` (no serializer); returns the
    grpc.RpcError the call ended with, or None when it succeeded."""
    try:
        if method.client_streaming and method.server_streaming:
            call = channel.stream_stream(path)
            list(call(iter([payload]), metadata=metadata, timeout=timeout))
        elif method.server_streaming:
            list(channel.unary_stream(path)(payload, metadata=metadata, timeout=timeout))
        elif method.client_streaming:
            channel.stream_unary(path)(iter([payload]), metadata=metadata, timeout=timeout)
        else:
            channel.unary_unary(path)(payload, metadata=metadata, timeout=timeout)
    except grpc.RpcError as exc:
        return exc
    return None


__all__ = ["LiveServices", "Target", "SERVICES", "method_paths", "raw_call"]
