"""A node agent against a recording scheduler (real gRPC servers on port 0, real processes): the
pieces the agent's integration tests share.

The workers are ``agent_fake_worker.py``, which follows the same bootstrap
contract as ``podium.worker.host.process`` (ready fd, one JSON line) and can be told to
crash, ignore SIGTERM, or stay silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import grpc
import pytest
import uvloop

from podium import rpc
from podium.v1 import common_pb2, node_pb2, node_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from podium.worker.agent.service import AgentConfig, run_agent
from tests.support.processes import FAKE_WORKER
from tests.support.waiting import eventually_async

TOKEN = "agent-test-token"
WAIT = 10.0  # every wait's deadline; generous for a loaded 2-core box


def run(coro):
    """Run a test coroutine on a uvloop loop, as the agent runs in production."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


async def eventually(predicate, what: str, timeout: float = WAIT):
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    return await eventually_async(predicate, what, timeout, interval=0.02)


class RecordingScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Records what the agent sends; answers like a scheduler would."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.registrations: list[scheduler_pb2.RegisterNodeRequest] = []
        self.heartbeats: list[scheduler_pb2.HeartbeatRequest] = []
        self.reports: list[scheduler_pb2.ReportWorkerRequest] = []
        self.reregister_next = False
        self.stop_next: list[str] = []

    async def RegisterNode(self, request, context):
        self.registrations.append(request)
        return scheduler_pb2.RegisterNodeResponse(lease_seconds=5, heartbeat_interval_seconds=self.interval,
                                                  scheduler_id="sched-test")

    async def Heartbeat(self, request, context):
        self.heartbeats.append(request)
        response = scheduler_pb2.HeartbeatResponse(reregister=self.reregister_next,
                                                   stop_worker_ids=self.stop_next)
        self.reregister_next, self.stop_next = False, []
        return response

    async def ReportWorker(self, request, context):
        self.reports.append(request)
        return scheduler_pb2.ReportWorkerResponse()

    def report(self, worker_id: str, state: int):
        """The first report of that worker in that state, or None."""
        return next((r for r in self.reports if r.worker_id == worker_id and r.state == state), None)


async def start_scheduler(port: int = 0):
    server, health = rpc.make_server(TOKEN)
    recorder = RecordingScheduler()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(recorder, server)
    port = rpc.bind(server, "127.0.0.1", port)
    await rpc.start_server(server, health)
    return server, recorder, port


@contextlib.asynccontextmanager
async def node(tmp_path, **overrides):
    """A recording scheduler and an agent with 2 fake GPUs whose workers are the fake worker."""
    server, recorder, port = await start_scheduler()
    config = AgentConfig(scheduler=f"127.0.0.1:{port}", node_id="node-a", cpus=4, fake_gpus=2,
                         log_dir=str(tmp_path / "logs"), token=TOKEN, stop_grace=2.0,
                         worker_command=[sys.executable, str(FAKE_WORKER)])
    for key, value in overrides.items():
        setattr(config, key, value)
    agent = await run_agent(config)
    channel = rpc.make_channel(agent.address, TOKEN)
    try:
        yield recorder, agent, node_pb2_grpc.NodeAgentStub(channel)
    finally:
        await agent.stop(grace=0.5)
        await channel.close()
        await server.stop(None)


def worker(worker_id: str, **env) -> common_pb2.WorkerInfo:
    """A WorkerInfo as the scheduler fills it in (env includes the system variables)."""
    system = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
              "CUDA_VISIBLE_DEVICES": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
              "PODIUM_LOCAL_WORLD_SIZE": "1", "RAY_LOCAL_WORLD_SIZE": "1", "WG_PREFIX": "grp",
              "WG_BACKEND": "podium", "PODIUM_WORKER_ID": worker_id,
              "PODIUM_NODE_ADDRESS": "127.0.0.1"}
    system.update(env)
    return common_pb2.WorkerInfo(id=worker_id, spec=common_pb2.WorkerSpec(name=f"grp_{worker_id}"),
                                 node_id="node-a", node_address="127.0.0.1", env=system)


async def spawn_running(stub, recorder, *infos, reserved_port: int = 0):
    """Spawn workers and wait until each is reported RUNNING."""
    response = await stub.SpawnWorkers(node_pb2.SpawnWorkersRequest(workers=infos,
                                                                    reserved_port=reserved_port),
                                       timeout=WAIT)
    for info in infos:
        await eventually(lambda: recorder.report(info.id, common_pb2.WORKER_RUNNING),
                         f"{info.id} RUNNING")
    return response


async def rpc_error(call):
    """The podium error a failing call raises."""
    with pytest.raises(grpc.RpcError) as caught:
        await call
    return rpc.error_from_rpc(caught.value)
