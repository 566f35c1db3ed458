"""Test doubles for scheduler tests: a fake node agent (a real grpc.aio NodeAgent
server that spawns nothing) and helpers to start an in-process scheduler."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from podium import errors, rpc
from podium.scheduler.client import SchedulerClient
from podium.scheduler.server import run_scheduler
from podium.scheduler.service import SchedulerConfig
from podium.v1 import common_pb2, node_pb2, node_pb2_grpc

GIB = 1 << 30


def node_info(node_id: str, address: str, agent_port: int, gpus: int = 4,
              cpus: float = 16) -> common_pb2.NodeInfo:
    """A NodeInfo with ``gpus`` fake 80 GiB GPUs."""
    return common_pb2.NodeInfo(
        node_id=node_id, address=address, agent_port=agent_port, cpus=cpus,
        hostname=f"host-{node_id}",
        gpus=[common_pb2.GpuInfo(index=i, uuid=f"GPU-{node_id}-{i}", name="Fake GPU",
                                 memory_total_bytes=80 * GIB) for i in range(gpus)])


@dataclass
class FakeAgent(node_pb2_grpc.NodeAgentServicer):
    """A NodeAgent that records calls and reports spawned workers RUNNING.

    ``fail_spawn`` / ``fail_stop`` / ``fail_reserve``: SpawnWorkers / StopWorkers / ReservePort fail UNAVAILABLE. ``auto_run``: after a spawn,
    report each worker RUNNING to the scheduler (as a real agent does).
    """

    node_id: str
    address: str
    token: str
    scheduler: str = ""
    auto_run: bool = True
    fail_spawn: bool = False
    fail_stop: bool = False
    fail_reserve: bool = False
    spawned: list = field(default_factory=list)
    stopped: list = field(default_factory=list)
    reserved: list = field(default_factory=list)
    spawn_requests: list = field(default_factory=list)
    port: int = 0

    def __post_init__(self) -> None:
        self._pids = itertools.count(1000)
        self._ports = itertools.count(41000)
        self._server = None
        self._tasks: set = set()

    async def start(self) -> "FakeAgent":
        """Serve on ``address`` port 0."""
        self._server, health = rpc.make_server(self.token)
        node_pb2_grpc.add_NodeAgentServicer_to_server(self, self._server)
        self.port = rpc.bind(self._server, self.address, 0)
        await rpc.start_server(self._server, health)
        return self

    async def stop(self) -> None:
        """Stop serving."""
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            await self._server.stop(0)

    def info(self, gpus: int = 4, cpus: float = 16) -> common_pb2.NodeInfo:
        """This agent's NodeInfo."""
        return node_info(self.node_id, self.address, self.port, gpus=gpus, cpus=cpus)

    @rpc.handle_errors
    async def SpawnWorkers(self, request, context):
        self.spawn_requests.append(request)
        if self.fail_spawn:
            raise errors.UnavailableError(f"{self.node_id}: cannot fork")
        out = node_pb2.SpawnWorkersResponse()
        for worker in request.workers:
            pid = next(self._pids)
            self.spawned.append(worker)
            out.workers.add(worker_id=worker.id, pid=pid, log_path=f"/tmp/{worker.id}.log")
            if self.auto_run:
                self._spawn_task(self._report(worker.id, pid))
        return out

    def _spawn_task(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _report_exit(self, worker_id: str) -> None:
        async with SchedulerClient(self.scheduler, self.token) as client:
            await client.report_worker(worker_id, common_pb2.WORKER_EXITED, node_id=self.node_id,
                                       exit=common_pb2.ExitInfo(signal=15))

    async def _report(self, worker_id: str, pid: int) -> None:
        async with SchedulerClient(self.scheduler, self.token) as client:
            await client.report_worker(worker_id, common_pb2.WORKER_RUNNING, node_id=self.node_id,
                                       pid=pid, port=next(self._ports))

    @rpc.handle_errors
    async def StopWorkers(self, request, context):
        if self.fail_stop:
            raise errors.UnavailableError(f"{self.node_id}: agent restarting")
        self.stopped.extend(request.worker_ids)
        if self.auto_run:
            # A real agent reports the exit once the process ends; until then the
            # scheduler holds the worker's slot and name.
            for worker_id in request.worker_ids:
                self._spawn_task(self._report_exit(worker_id))
        return node_pb2.StopWorkersResponse(stopped=len(request.worker_ids))

    @rpc.handle_errors
    async def ReservePort(self, request, context):
        if self.fail_reserve:
            raise errors.UnavailableError(f"{self.node_id}: no free port")
        port = next(self._ports)
        self.reserved.append(port)
        return node_pb2.ReservePortResponse(port=port)


def config(token: str, **overrides) -> SchedulerConfig:
    """A scheduler config on free loopback ports, in-memory state."""
    values = dict(token=token, host="127.0.0.1", port=0, http_port=0, state=":memory:")
    values.update(overrides)
    return SchedulerConfig(**values)


class Cluster:
    """An in-process scheduler plus fake agents, and a client (async context manager)."""

    def __init__(self, token: str, agents: int = 2, gpus: int = 4, **overrides) -> None:
        self.token = token
        self.n_agents = agents
        self.gpus = gpus
        self.overrides = overrides
        self.agents: list[FakeAgent] = []

    async def __aenter__(self) -> "Cluster":
        self.running = await run_scheduler(config(self.token, **self.overrides))
        self.client = SchedulerClient(self.running.address, self.token, timeout=10)
        for i in range(self.n_agents):
            agent = await FakeAgent(node_id=f"node-{chr(ord('a') + i)}", address=f"127.0.0.{2 + i}",
                                    token=self.token, scheduler=self.running.address).start()
            self.agents.append(agent)
            await self.client.register_node(agent.info(gpus=self.gpus))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        for agent in self.agents:
            await agent.stop()
        await self.running.stop(0)
