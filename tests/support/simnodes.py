"""Simulated node agents: many GPU nodes in one process, for load tests of a real scheduler.

``python -m tests.support.simnodes --scheduler HOST:PORT --nodes 1000 --gpus 8`` (from the
repository root) plays a thousand 8-GPU machines against a real scheduler over the real gRPC
contract. Each simulated node runs the node agent's own link to the scheduler
(:class:`~podium.worker.agent.link.SchedulerLink`: register, heartbeat, register again,
back off) over shared connections; only what a node *is* is simulated: it registers with its
GPU inventory, heartbeats at the interval the scheduler gives it (GPU memory readings,
per-process memory and its running workers, as :mod:`podium.worker.agent.service` sends
them) and answers the scheduler's ``NodeAgent`` calls: spawning a worker gives it a pid and
reports it RUNNING on a made-up port, stopping one reports it EXITED. Nothing is forked and
no GPU is touched, so one machine holds 1,000 nodes.

All simulated nodes share one ``NodeAgent`` server (one address and port: the scheduler
dials each node's ``address:agent_port``, and a request names its workers, so the server
knows which node is meant) and a few client connections to the scheduler.

:class:`SimulatedNodes` is the library face (the scale benchmark and the scale test run
it in their own event loop); :func:`main` is the command line (the benchmark runs it in a
process of its own), which writes what it saw
(registrations, heartbeat latencies) as JSON to ``--stats-file`` when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from podium import errors, rpc
from podium.auth import TlsConfig, resolve_token
from podium.limits import MAX_REPEATED
from podium.rpc import error_from_rpc
from podium.scheduler.client import HeartbeatStream
from podium.v1 import common_pb2, node_pb2, node_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from podium.worker.agent.link import SchedulerLink
from podium.worker.agent.service import RPC_TIMEOUT_SECONDS
from podium.worker.agent.gpus import DEFAULT_FAKE_MEMORY, fake_uuid

log = logging.getLogger(__name__)

__all__ = ["SimulatedNodes", "SimStats", "MAX_SIM_NODES", "MAX_SIM_GPUS", "main"]

#: Most nodes one simulator plays (each costs a task and a few kB).
MAX_SIM_NODES = 10_000
#: Most GPUs per simulated node.
MAX_SIM_GPUS = 64
#: Most connections to the scheduler one simulator opens.
MAX_SIM_CONNECTIONS = 256
#: Heartbeat latency samples kept (the oldest are dropped beyond it).
MAX_SAMPLES = 2_000_000
#: Registrations in flight at once when the simulator starts (a cold cluster's storm).
REGISTER_CONCURRENCY = 64
#: Device memory a simulated worker reports holding on each of its GPUs.
WORKER_MEMORY_BYTES = 2 << 30


@dataclass
class _Worker:
    worker_id: str
    pid: int
    port: int
    gpu_uuids: tuple[str, ...]


@dataclass
class _Node:
    """One simulated machine."""

    info: common_pb2.NodeInfo
    number: int = 0
    workers: dict[str, _Worker] = field(default_factory=dict)
    #: The heartbeat request, rebuilt only when the workers change.
    request: scheduler_pb2.HeartbeatRequest | None = None
    #: Its link to the scheduler (the real agent's loop); set by SimulatedNodes.start.
    link: SchedulerLink | None = None

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self.info.node_id

    @property
    def registrations(self) -> int:
        """Successful RegisterNode calls so far."""
        return self.link.registrations if self.link is not None else 0

    @property
    def heartbeats(self) -> int:
        """Heartbeats the scheduler answered."""
        return self.link.heartbeats if self.link is not None else 0

    @property
    def registered(self) -> bool:
        """True while registered (between a registration and the loss of the scheduler)."""
        return self.link is not None and self.link.registered.is_set()

    def heartbeat_request(self) -> scheduler_pb2.HeartbeatRequest:
        """GPU readings, per-process memory and running workers, as the real agent sends."""
        if self.request is None:
            held: dict[str, int] = {}
            processes = []
            for w in self.workers.values():
                for uuid in w.gpu_uuids:
                    held[uuid] = held.get(uuid, 0) + WORKER_MEMORY_BYTES
                    processes.append(common_pb2.ProcessMemory(
                        pid=w.pid, gpu_uuid=uuid, used_bytes=WORKER_MEMORY_BYTES,
                        worker_id=w.worker_id))
            gpus = [common_pb2.GpuInfo(index=g.index, uuid=g.uuid, name=g.name,
                                       memory_total_bytes=g.memory_total_bytes,
                                       memory_used_bytes=held.get(g.uuid, 0))
                    for g in self.info.gpus]
            self.request = scheduler_pb2.HeartbeatRequest(
                node_id=self.node_id, gpus=gpus, processes=processes, running=self.running())
        return self.request

    def running(self) -> list[scheduler_pb2.RunningWorker]:
        """The workers this node runs, as RegisterNode and Heartbeat list them."""
        return [scheduler_pb2.RunningWorker(worker_id=w.worker_id, pid=w.pid, port=w.port)
                for w in self.workers.values()]


@dataclass
class SimStats:
    """What the simulated nodes saw (all times Unix seconds, latencies seconds)."""

    #: (sent at, latency, node number) of every answered heartbeat, oldest first (at most
    #: MAX_SAMPLES).
    heartbeats: list[tuple[float, float, int]] = field(default_factory=list)
    #: Heartbeats that failed (the scheduler was down or too slow), and when.
    heartbeat_failures: list[float] = field(default_factory=list)
    #: Heartbeats answered "register again" (the scheduler had forgotten or buried the node).
    reregister_asked: list[float] = field(default_factory=list)
    #: Successful RegisterNode calls: (at, node id).
    registrations: list[tuple[float, str]] = field(default_factory=list)
    #: (at, seconds) by which the simulator's own loop woke late from a 50 ms sleep: how
    #: much of a heartbeat's latency is this process waiting for a core, not the scheduler.
    loop_lag: list[tuple[float, float]] = field(default_factory=list)
    spawned: int = 0
    stopped: int = 0

    def as_json(self) -> dict:
        """A JSON-ready dict."""
        return {"heartbeats": self.heartbeats, "heartbeat_failures": self.heartbeat_failures,
                "reregister_asked": self.reregister_asked, "registrations": self.registrations,
                "loop_lag": self.loop_lag, "spawned": self.spawned, "stopped": self.stopped}


def _check_count(value: int, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise errors.InvalidArgumentError(f"{what} must be an integer in [{low}, {high}], got {value!r}")
    return value


class SimulatedNodes(node_pb2_grpc.NodeAgentServicer):
    """``count`` simulated nodes of ``gpus`` GPUs each, against the scheduler at ``scheduler``.

    ``await start()`` serves the shared NodeAgent service and starts every node (they
    register in the background; :meth:`wait_registered` waits for all); ``await stop()``
    ends them (nothing is reported: a stopped simulator is a cluster that vanished).
    """

    def __init__(self, scheduler: str, token: str, *, count: int, gpus: int = 8,
                 cpus: float = 64.0, host: str = "127.0.0.1", prefix: str = "sim",
                 connections: int = 8, tls: TlsConfig | None = None,
                 gpu_memory_bytes: int = DEFAULT_FAKE_MEMORY, seed: int = 0) -> None:
        _check_count(count, 1, MAX_SIM_NODES, "simulated nodes")
        _check_count(gpus, 0, MAX_SIM_GPUS, "GPUs per simulated node")
        _check_count(connections, 1, MAX_SIM_CONNECTIONS, "connections to the scheduler")
        if not 0 <= cpus <= 100_000:
            raise errors.InvalidArgumentError(f"cpus per simulated node must be in [0, 100000], got {cpus!r}")
        self.scheduler = scheduler
        self.token = token
        self.host = host
        self.tls = tls
        self.stats = SimStats()
        self._metadata = rpc.token_metadata(token)
        self._rng = random.Random(seed)
        self._cpus = float(cpus)
        self._gpu_count = gpus
        self._gpu_memory = gpu_memory_bytes
        self._connections = connections
        self._prefix = prefix
        self.nodes: dict[str, _Node] = {}
        self._count = count
        self._where: dict[str, _Node] = {}  # worker id -> its node
        self._pids = itertools.count(10_000)
        self._ports = itertools.count(0)
        self._server: grpc.aio.Server | None = None
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[scheduler_pb2_grpc.SchedulerStub] = []
        self._streams: list[HeartbeatStream] = []
        self._tasks: list[asyncio.Task] = []
        self._side: set[asyncio.Task] = set()
        self._register_gate: asyncio.Semaphore | None = None
        self._stopping = False
        self._stop = asyncio.Event()
        self.port = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> "SimulatedNodes":
        """Serve the NodeAgent service, connect to the scheduler, start every node."""
        self._server, health = rpc.make_server(self.token)
        node_pb2_grpc.add_NodeAgentServicer_to_server(self, self._server)
        self.port = rpc.bind(self._server, self.host, 0, self.tls)
        await rpc.start_server(self._server, health)
        for _ in range(self._connections):
            # A local subchannel pool: each channel is its own TCP connection, as separate
            # machines' agents would be (channels to one target share one otherwise).
            channel = rpc.make_channel(self.scheduler, self.token, self.tls, add_token=False,
                                       extra_options=(("grpc.use_local_subchannel_pool", 1),))
            self._channels.append(channel)
            self._stubs.append(scheduler_pb2_grpc.SchedulerStub(channel))
        width = len(str(self._count - 1))
        for i in range(self._count):
            node_id = f"{self._prefix}-{i:0{width}d}"
            info = common_pb2.NodeInfo(
                node_id=node_id, address=self.host, agent_port=self.port, cpus=self._cpus,
                hostname=node_id, labels={"simulated": "1"},
                gpus=[common_pb2.GpuInfo(index=g, uuid=fake_uuid(node_id, g), name="Simulated GPU",
                                         memory_total_bytes=self._gpu_memory)
                      for g in range(self._gpu_count)])
            self.nodes[node_id] = _Node(info, i)
        self._register_gate = asyncio.Semaphore(REGISTER_CONCURRENCY)
        loop = asyncio.get_running_loop()
        for i, node in enumerate(self.nodes.values()):
            node.link = self._link(node, self._stubs[i % len(self._stubs)])
        self._tasks = [loop.create_task(node.link.run(), name=f"sim-{node.node_id}")
                       for node in self.nodes.values() if node.link is not None]
        self._tasks.append(loop.create_task(self._watch_lag(), name="sim-loop-lag"))
        return self

    async def stop(self) -> None:
        """End every node and stop serving."""
        self._stopping = True
        self._stop.set()
        for task in [*self._tasks, *self._side]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._side, return_exceptions=True)
        self._tasks = []
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        for beats in self._streams:
            beats.close()
        self._streams = []
        for channel in self._channels:
            await channel.close()
        self._channels, self._stubs = [], []

    async def wait_registered(self, timeout: float) -> None:
        """Return once every node has registered at least once (DeadlineExceededError)."""
        deadline = time.monotonic() + timeout
        while not all(n.registrations for n in self.nodes.values()):
            if time.monotonic() > deadline:
                missing = sum(1 for n in self.nodes.values() if not n.registrations)
                raise errors.DeadlineExceededError(
                    f"{missing} of {len(self.nodes)} simulated nodes not registered after {timeout} s")
            await asyncio.sleep(0.05)

    async def _watch_lag(self, period: float = 0.05) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            asked = loop.time()
            await asyncio.sleep(period)
            if len(self.stats.loop_lag) >= MAX_SAMPLES:
                del self.stats.loop_lag[:MAX_SAMPLES // 10]
            self.stats.loop_lag.append((time.time(), loop.time() - asked - period))

    # ------------------------------------------------------------ one node's life

    async def _call(self, stub, method: str, request):
        return await getattr(stub, method)(request, timeout=RPC_TIMEOUT_SECONDS,
                                           metadata=self._metadata)

    def _link(self, node: _Node, stub: scheduler_pb2_grpc.SchedulerStub) -> SchedulerLink:
        """The agent's own loop for one node, over a shared connection, recording what it sees."""
        stats = self.stats
        # Each node beats on a stream of its own, as the real agent does.
        beats = HeartbeatStream(stub, timeout=RPC_TIMEOUT_SECONDS, what=f"node {node.node_id}",
                                metadata=self._metadata)
        self._streams.append(beats)

        async def register() -> scheduler_pb2.RegisterNodeResponse:
            assert self._register_gate is not None
            try:
                async with self._register_gate:  # a cold cluster's storm, REGISTER_CONCURRENCY wide
                    response = await self._call(stub, "RegisterNode", scheduler_pb2.RegisterNodeRequest(
                        node=node.info, running=node.running()))
            except grpc.RpcError as exc:
                raise error_from_rpc(exc, what=f"node {node.node_id} RegisterNode") from None
            stats.registrations.append((time.time(), node.node_id))
            return response

        async def beat() -> scheduler_pb2.HeartbeatResponse:
            sent = time.time()
            started = time.perf_counter()
            try:
                response = await beats.beat(node.heartbeat_request())
            except errors.PodiumError:
                stats.heartbeat_failures.append(sent)
                raise
            if len(stats.heartbeats) >= MAX_SAMPLES:
                del stats.heartbeats[:MAX_SAMPLES // 10]
            stats.heartbeats.append((sent, time.perf_counter() - started, node.number))
            if response.reregister:
                stats.reregister_asked.append(sent)
            return response

        def unwanted(worker_ids) -> None:
            for worker_id in worker_ids:
                self._forget(worker_id, report=False)

        return SchedulerLink(node.node_id, register=register, beat=beat, unwanted=unwanted,
                             stop=self._stop, jitter=self._rng.random, spread=self._rng.random,
                             scheduler=self.scheduler)

    # ------------------------------------------------------------ the NodeAgent service

    def _report_later(self, node: _Node, request: scheduler_pb2.ReportWorkerRequest) -> None:
        async def report() -> None:
            for attempt in range(5):
                try:
                    await self._call(self._stubs[0], "ReportWorker", request)
                    return
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        return
                    await asyncio.sleep(0.1 * 2 ** attempt)
        task = asyncio.get_running_loop().create_task(report())
        self._side.add(task)
        task.add_done_callback(self._side.discard)

    def _forget(self, worker_id: str, *, report: bool) -> bool:
        node = self._where.pop(worker_id, None)
        if node is None:
            return False
        worker = node.workers.pop(worker_id, None)
        node.request = None
        if report and worker is not None:
            self._report_later(node, scheduler_pb2.ReportWorkerRequest(
                worker_id=worker_id, node_id=node.node_id, state=common_pb2.WORKER_EXITED,
                pid=worker.pid, exit=common_pb2.ExitInfo(exit_code=0, requested=True,
                                                         reason="stopped (simulated)")))
        self.stats.stopped += 1
        return True

    @rpc.handle_errors
    async def SpawnWorkers(self, request, context):
        """Give each worker a pid now and report it RUNNING on a made-up port."""
        if len(request.workers) > MAX_REPEATED:
            raise errors.InvalidArgumentError(f"{len(request.workers)} workers, more than {MAX_REPEATED}")
        unknown = sorted({w.node_id for w in request.workers if w.node_id not in self.nodes})
        if unknown:
            raise errors.NotFoundError(f"no simulated node {unknown[0]!r} here")
        out = node_pb2.SpawnWorkersResponse()
        for info in request.workers:
            node = self.nodes[info.node_id]
            uuids = {g.index: g.uuid for g in node.info.gpus}
            worker = _Worker(info.id, next(self._pids), 20_000 + next(self._ports) % 40_000,
                             tuple(uuids[i] for i in info.gpu_indices if i in uuids))
            node.workers[info.id] = worker
            node.request = None
            self._where[info.id] = node
            self.stats.spawned += 1
            out.workers.add(worker_id=info.id, pid=worker.pid, log_path="")
            self._report_later(node, scheduler_pb2.ReportWorkerRequest(
                worker_id=info.id, node_id=node.node_id, state=common_pb2.WORKER_RUNNING,
                pid=worker.pid, port=worker.port))
        return out

    @rpc.handle_errors
    async def StopWorkers(self, request, context):
        """Forget the workers and report each EXITED."""
        if len(request.worker_ids) > MAX_REPEATED:
            raise errors.InvalidArgumentError(f"{len(request.worker_ids)} ids, more than {MAX_REPEATED}")
        stopped = sum(1 for worker_id in request.worker_ids if self._forget(worker_id, report=True))
        return node_pb2.StopWorkersResponse(stopped=stopped)

    @rpc.handle_errors
    async def ReservePort(self, request, context):
        """A made-up port (nothing listens on a simulated node)."""
        return node_pb2.ReservePortResponse(port=20_000 + next(self._ports) % 40_000)

    @rpc.handle_errors
    async def ListWorkers(self, request, context):
        """Every simulated worker, RUNNING."""
        out = node_pb2.ListWorkersResponse()
        for node in self.nodes.values():
            for w in node.workers.values():
                out.workers.add(id=w.worker_id, node_id=node.node_id, pid=w.pid, port=w.port,
                                state=common_pb2.WORKER_RUNNING)
        return out

    @rpc.handle_errors
    async def TailLog(self, request, context):
        """Simulated workers write no logs."""
        raise errors.NotFoundError(f"simulated worker {request.worker_id!r} has no log")
        yield  # pragma: no cover - makes this an async generator, as the stream needs

    @rpc.handle_errors
    async def GetNodeInfo(self, request, context):
        """Many nodes share this address: there is no single answer."""
        raise errors.FailedPreconditionError(
            f"{len(self.nodes)} simulated nodes share this address; ask the scheduler")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.support.simnodes",
                                description="Simulated GPU nodes against a real scheduler.")
    p.add_argument("--scheduler", required=True, help="HOST:PORT of the scheduler")
    p.add_argument("--nodes", type=int, default=1000, help=f"simulated nodes (1..{MAX_SIM_NODES})")
    p.add_argument("--gpus", type=int, default=8, help=f"GPUs per node (0..{MAX_SIM_GPUS})")
    p.add_argument("--cpus", type=float, default=64.0, help="CPUs per node")
    p.add_argument("--host", default="127.0.0.1", help="address the shared NodeAgent serves on")
    p.add_argument("--prefix", default="sim", help="node ids are PREFIX-0000, PREFIX-0001, ...")
    p.add_argument("--connections", type=int, default=8,
                   help=f"TCP connections to the scheduler (1..{MAX_SIM_CONNECTIONS})")
    p.add_argument("--token-file", default=None, help="cluster token file (PODIUM_TOKEN wins)")
    p.add_argument("--stats-file", default=None, help="write what was seen as JSON here on exit")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


async def _serve(args: argparse.Namespace, token: str) -> None:
    sim = SimulatedNodes(args.scheduler, token, count=args.nodes, gpus=args.gpus, cpus=args.cpus,
                         host=args.host, prefix=args.prefix, connections=args.connections)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await sim.start()
    try:
        await stop.wait()
    finally:
        await sim.stop()
        if args.stats_file:
            tmp = f"{args.stats_file}.tmp{os.getpid()}"
            with open(tmp, "w") as handle:
                json.dump(sim.stats.as_json(), handle)
            os.replace(tmp, args.stats_file)


def main(argv: Sequence[str] | None = None) -> int:
    """Run simulated nodes until SIGTERM/SIGINT; returns the exit status."""
    args = _parse(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        token = resolve_token(token_file=args.token_file)
        rpc.use_uvloop()
        asyncio.run(_serve(args, token))
    except errors.PodiumError as exc:
        print(f"simnodes: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
