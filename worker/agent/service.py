"""The node agent: one per machine (``podium node --scheduler HOST:PORT``).

It serves the ``NodeAgent`` gRPC service on its node address, registers the
machine (CPUs, GPUs from NVML or ``--fake-gpus``) with the scheduler, heartbeats
memory readings and live workers, starts and stops worker processes when the
scheduler asks (:mod:`podium.worker.agent.spawner`) and reports how each one ends.
The scheduler being down never stops it: it retries with backoff and registers
again when the scheduler is back. SIGTERM or SIGINT stop every worker (whole
process groups, SIGKILL after the grace period), report them and exit 0.

This module never imports torch: the agent must start fast and stay small.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import signal
import socket
import sys
from typing import TYPE_CHECKING, Sequence

import grpc

from podium import errors, process, rpc
from podium.transport import shm
from podium.auth import resolve_token
from podium.private import given_dir, private_dir, write_private_atomic
from podium.limits import (MAX_GRACE_SECONDS, MAX_PORT_HOLD_SECONDS, MAX_TAIL_LINES,
                           check_repeated_fields, check_seconds)
from podium.scheduler.client import SchedulerClient
from podium.v1 import common_pb2, node_pb2, node_pb2_grpc, scheduler_pb2
from podium.worker import usermetrics
from podium.worker.agent.gpus import GpuProvider, detect
from podium.worker.agent.config import AgentConfig, build_parser, config_from_args
from podium.worker.agent.drivers import Drivers
from podium.worker.agent.link import MAX_BACKOFF_SECONDS, RETRYABLE, SchedulerLink
from podium.worker.agent.logtail import LogFollower, file_size
from podium.worker.agent.ports import PortHolds
from podium.worker.agent.exitinfo import read_tail
from podium.worker.agent.spawner import Spawner

if TYPE_CHECKING:  # imported when --metrics-port asks for it (aiohttp is not light)
    from podium.worker.agent.metrics import MetricsServer

log = logging.getLogger(__name__)

__all__ = ["AgentConfig", "RunningAgent", "NodeAgentService", "run_agent", "main",
           "build_parser", "config_from_args", "PortHolds"]

#: Deadline of each call to the scheduler.
RPC_TIMEOUT_SECONDS = 5.0
#: How long ReservePort holds a port when the request does not say.
DEFAULT_PORT_HOLD_SECONDS = 60.0
#: How often the agent removes shared-memory segments of dead processes.
SHM_SWEEP_SECONDS = 60.0
#: How often a following TailLog looks for new lines.
TAIL_POLL_SECONDS = 0.2
#: On shutdown, how long queued reports may take to reach the scheduler.
REPORT_FLUSH_SECONDS = 3.0



class NodeAgentService(node_pb2_grpc.NodeAgentServicer):
    """The ``podium.v1.NodeAgent`` service over one :class:`RunningAgent`."""

    def __init__(self, agent: "RunningAgent") -> None:
        self._agent = agent

    @rpc.handle_errors
    async def SpawnWorkers(self, request, context):
        """Start the workers; the reserved MASTER_PORT's socket goes to the master worker
        (``master_worker_id``), or is released just before when none is named."""
        spawner = self._agent.spawner
        check_repeated_fields(request)
        spawner.validate(request.workers)
        if request.master_worker_id and request.master_worker_id not in {w.id for w in request.workers}:
            raise errors.InvalidArgumentError(
                f"master_worker_id {request.master_worker_id!r} is not one of the workers to spawn")
        held = self._agent.ports.hand_over(request.reserved_port) if request.reserved_port else None
        if request.reserved_port and held is None:
            log.warning("port %d was not held any more (expired?); spawning anyway",
                        request.reserved_port)
        if held is not None and not request.master_worker_id:
            held.close()  # no worker serves it: the one whose env names it binds it
            held = None
        try:
            listen = {request.master_worker_id: held.fileno()} if held is not None else {}
            spawned = await spawner.spawn(request.workers, listen=listen)
        finally:
            if held is not None:
                held.close()  # the worker has its own copy now (or failed: the port is free)
        return node_pb2.SpawnWorkersResponse(workers=spawned)

    @rpc.handle_errors
    async def StopWorkers(self, request, context):
        """Stop workers (returns once they are reaped)."""
        check_repeated_fields(request)
        check_seconds(request.grace_seconds, "grace_seconds", MAX_GRACE_SECONDS)
        stopped = await self._agent.spawner.stop(request.worker_ids, request.grace_seconds)
        return node_pb2.StopWorkersResponse(stopped=stopped)

    @rpc.handle_errors
    async def ReservePort(self, request, context):
        """Hold a free port on the node address."""
        hold = check_seconds(request.hold_seconds, "hold_seconds", MAX_PORT_HOLD_SECONDS)
        port = self._agent.ports.reserve(hold or DEFAULT_PORT_HOLD_SECONDS)
        return node_pb2.ReservePortResponse(port=port)

    @rpc.handle_errors
    async def ListWorkers(self, request, context):
        """Every worker this agent started, with state, pid, port and exit."""
        return node_pb2.ListWorkersResponse(
            workers=[w.to_proto() for w in self._agent.spawner.workers()])

    @rpc.handle_errors
    async def TailLog(self, request, context):
        """Last lines of stdout then stderr; with follow, new lines until the worker exits."""
        worker = self._agent.spawner.get(request.worker_id)
        if not 0 <= request.last_lines <= MAX_TAIL_LINES:
            raise errors.InvalidArgumentError(
                f"last_lines must be in [0, {MAX_TAIL_LINES}], got {request.last_lines}")
        followers = []
        try:
            for stream, path in (("stdout", worker.out_path), ("stderr", worker.err_path)):
                end = file_size(path)
                if request.last_lines:
                    texts = read_tail(path, request.last_lines, end=end)
                    follower = LogFollower(stream, path, end)
                else:
                    # The whole file, read in bounded chunks (a log can be gigabytes).
                    follower = LogFollower(stream, path, 0)
                    texts = follower.drain(final=not request.follow, until=end)
                followers.append(follower)
                for text in texts:
                    yield node_pb2.LogLine(worker_id=worker.id, stream=stream, text=text)
            if not request.follow:
                return
            while True:
                finished = worker.exited.done()
                for follower in followers:
                    for text in follower.drain(final=finished):
                        yield node_pb2.LogLine(worker_id=worker.id, stream=follower.stream, text=text)
                if finished:
                    return
                await asyncio.wait({worker.exited}, timeout=TAIL_POLL_SECONDS)
        finally:
            for follower in followers:
                follower.close()

    @rpc.handle_errors
    async def GetNodeInfo(self, request, context):
        """Inventory with fresh memory readings."""
        return self._agent.node_info()

    @rpc.handle_errors
    async def ProcessStates(self, request, context):
        """/proc state of the named workers (or of every live one): only workers it runs."""
        check_repeated_fields(request)
        spawner = self._agent.spawner
        ids = list(request.worker_ids) or [w.id for w in spawner.workers() if w.alive]
        known = {w.id: w for w in spawner.workers()}
        states = []
        for worker_id in ids:
            worker = known.get(worker_id)
            if worker is None:
                states.append(node_pb2.ProcessState(worker_id=worker_id, state_name="unknown worker"))
            elif not worker.alive:
                states.append(node_pb2.ProcessState(worker_id=worker_id, pid=worker.pid,
                                                    state_name="not running"))
            else:
                letter, name, wchan, threads = process.kernel_state(worker.pid)
                states.append(node_pb2.ProcessState(worker_id=worker_id, pid=worker.pid, state=letter,
                                                    state_name=name, wchan=wchan, threads=threads))
        return node_pb2.ProcessStatesResponse(states=states)

    @rpc.handle_errors
    async def StartDriver(self, request, context):
        """Start a submitted job's driver here (podium.worker.agent.drivers)."""
        check_repeated_fields(request)
        return await self._agent.drivers.start(request)

    @rpc.handle_errors
    async def ReadDriverLog(self, request, context):
        """A chunk of a driver's log, and whether it has ended."""
        return self._agent.drivers.read(request)

    @rpc.handle_errors
    async def StopDriver(self, request, context):
        """Stop a driver (returns once it has ended); forget one that had ended."""
        check_seconds(request.grace_seconds, "grace_seconds", MAX_GRACE_SECONDS)
        running = await self._agent.drivers.stop(request.driver_id, request.grace_seconds)
        return node_pb2.StopDriverResponse(was_running=running)


class RunningAgent:
    """A node agent serving in this process (what :func:`run_agent` returns)."""

    def __init__(self, config: AgentConfig, token: str) -> None:
        self.config = config
        self.token = token
        self.host = config.host
        #: The address other processes reach this node at (registered, MASTER_ADDR, workers bind it).
        self.node_address = config.advertise_address or config.host
        if self.node_address in ("0.0.0.0", "::", ""):
            raise errors.InvalidArgumentError(
                f"--host {config.host} is not an address others can reach: give --advertise-address")
        self.node_id = config.node_id or f"{socket.gethostname()}-{self.node_address}"
        self.cpus = float(config.cpus if config.cpus is not None else (os.cpu_count() or 1))
        #: Custom resources offered, with ``memory`` (bytes) the machine's unless given.
        self.resources = {"memory": float(_physical_memory()), **config.resources}
        # A given folder must be one no other user can plant a fork server's socket in (#48).
        self.log_dir = (given_dir(config.log_dir, "podium node --log-dir") if config.log_dir
                        else pathlib.Path.home() / ".podium" / "logs" / self.node_id)
        self.provider: GpuProvider = config.provider or detect(
            config.fake_gpus, fake_memory_bytes=config.fake_gpu_memory, node_id=self.node_id)
        self.port = 0
        #: The /metrics server (podium.worker.agent.metrics), when --metrics-port is given.
        self.metrics: MetricsServer | None = None
        self.ports = PortHolds(config.host)
        #: Submitted jobs' drivers the scheduler placed here (podium.worker.agent.drivers).
        self.drivers = Drivers(self.log_dir / "drivers", tls=config.tls, state_dir=self.log_dir)
        #: Where workers leave their application metrics (ray.util.metrics) for /metrics
        #: (podium.worker.usermetrics); only when this agent serves /metrics.
        self.metrics_dir: pathlib.Path | None = None
        base_env = None
        if config.metrics_port is not None:
            self.metrics_dir = self.log_dir / "metrics"
            base_env = {**os.environ, usermetrics.DIR_ENV: str(self.metrics_dir)}
        self.spawner = Spawner(log_dir=self.log_dir, node_id=self.node_id, node_address=self.node_address,
                               scheduler=config.scheduler, token=token, report=self._enqueue_report,
                               command=config.worker_command, stop_grace=config.stop_grace,
                               tls=config.tls, base_env=base_env)
        if self.metrics_dir is not None:
            private_dir(self.metrics_dir)  # after the spawner made log_dir (0700)
        self._reports: asyncio.Queue[scheduler_pb2.ReportWorkerRequest] = asyncio.Queue()
        self._stop = asyncio.Event()
        #: Registration and heartbeats with the scheduler (podium.worker.agent.link).
        self.link = SchedulerLink(self.node_id, register=self._register, beat=self._beat,
                                  unwanted=self._stop_unwanted, stop=self._stop,
                                  fence=self.spawner.fence, renewed=self.spawner.note_fence_deadline,
                                  scheduler=config.scheduler)
        #: Set whenever a registration succeeds; cleared when the scheduler is lost.
        self.registered = self.link.registered
        self._stopped = asyncio.Event()
        self._stopping = False
        self._server: grpc.aio.Server | None = None
        self._scheduler: SchedulerClient | None = None
        self._tasks: list[asyncio.Task] = []
        self._side_tasks: set[asyncio.Task] = set()

    @property
    def registrations(self) -> int:
        """Successful RegisterNode calls so far (a re-registration adds one)."""
        return self.link.registrations

    @property
    def scheduler_id(self) -> str:
        """Id of the scheduler incarnation last registered with."""
        return self.link.scheduler_id

    @property
    def address(self) -> str:
        """"host:port" of the agent's gRPC service, as others reach it."""
        return f"{self.node_address}:{self.port}"

    # ------------------------------------------------------------ lifecycle

    async def _start(self) -> None:
        self._server, health = rpc.make_server(self.token)
        node_pb2_grpc.add_NodeAgentServicer_to_server(NodeAgentService(self), self._server)
        try:
            self.port = rpc.bind(self._server, self.host, self.config.port, self.config.tls)
        except RuntimeError as exc:  # grpcio raises this instead of returning 0
            raise errors.UnavailableError(
                f"node agent cannot serve on {self.host}:{self.config.port}: {exc}") from None
        await rpc.start_server(self._server, health)
        if self.config.metrics_port is not None:
            from podium.worker.agent.metrics import MetricsServer
            metrics = self.metrics = MetricsServer(self)
            await metrics.start(self.host, self.config.metrics_port)
        self._scheduler = SchedulerClient(self.config.scheduler, self.token, self.config.tls,
                                          timeout=RPC_TIMEOUT_SECONDS)
        # Workers a SIGKILLed previous agent of this node left running: taken over before the
        # node registers, so the scheduler hears of them as running and the job never notices.
        adopted = await self.spawner.adopt()
        if adopted:
            log.warning("node agent %s restarted: re-adopted %d running worker(s)", self.node_id, adopted)
            self.link.inherit_fence(self.spawner.inherited_fence_at)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.link.run(), name="agent-heartbeat"),
                       loop.create_task(self._report_loop(), name="agent-reports"),
                       loop.create_task(self._shm_sweep_loop(), name="agent-shm-sweep")]
        if self.config.port_file:
            _write_json_atomic(self.config.port_file, {"port": self.port, "pid": os.getpid(),
                                                       "node_id": self.node_id,
                                                       "address": self.node_address,
                                                       "metrics_port": self.metrics.port if self.metrics else 0})
        log.info("node agent %s serving on %s (%g CPUs, %d GPUs, logs in %s), scheduler %s",
                 self.node_id, self.address, self.cpus, len(self.provider.gpus()), self.log_dir,
                 self.config.scheduler)

    async def stop(self, grace: float = 0.0) -> None:
        """Stop every worker (SIGTERM, SIGKILL after ``grace``), report them, stop serving."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        self._stop.set()
        stopped = await self.spawner.stop_all(grace)
        await self.drivers.stop_all()
        log.info("node agent %s: stopped %d workers", self.node_id, stopped)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._reports.join(), REPORT_FLUSH_SECONDS)
        await self._close()

    async def _close(self) -> None:
        """Release everything but the workers (also undoes a half-finished start)."""
        tasks = [*self._tasks, *self._side_tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(grace=0.5)
        if self.metrics is not None:
            await self.metrics.stop()
        if self._scheduler is not None:
            await self._scheduler.close()
        self.ports.close()
        self.provider.close()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        """Return once :meth:`stop` has finished."""
        await self._stopped.wait()

    # ------------------------------------------------------------ readings

    def node_info(self) -> common_pb2.NodeInfo:
        """Identity, address and inventory with fresh memory readings."""
        return common_pb2.NodeInfo(node_id=self.node_id, address=self.node_address, agent_port=self.port,
                                   cpus=self.cpus, gpus=self._gpus(), hostname=socket.gethostname(),
                                   labels=self.config.labels, resources=self.resources)

    def _gpus(self) -> list[common_pb2.GpuInfo]:
        return [common_pb2.GpuInfo(index=g.index, uuid=g.uuid, name=g.name,
                                   memory_total_bytes=g.memory_total_bytes,
                                   memory_used_bytes=g.memory_used_bytes)
                for g in self.provider.gpus()]

    def _processes(self) -> list[common_pb2.ProcessMemory]:
        return [common_pb2.ProcessMemory(pid=p.pid, gpu_uuid=p.gpu_uuid, used_bytes=p.used_bytes,
                                         worker_id=self.spawner.worker_of_pid(p.pid))
                for p in self.provider.processes()]

    # ------------------------------------------------------------ scheduler link

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopping; True when the agent is stopping."""
        return await self.link.sleep(seconds)

    async def _register(self) -> scheduler_pb2.RegisterNodeResponse:
        return await self._client().register_node(self.node_info(), self.spawner.running())

    async def _beat(self) -> scheduler_pb2.HeartbeatResponse:
        return await self._client().heartbeat(self.node_id, self._gpus(), self._processes(),
                                              self.spawner.running())

    def _client(self) -> SchedulerClient:
        if self._scheduler is None:
            raise errors.FailedPreconditionError(f"node agent {self.node_id} is not started")
        return self._scheduler

    async def _shm_sweep_loop(self) -> None:
        """Remove shared-memory segments whose creator died before a reader mapped them.

        A reaped worker's segments go at once (the spawner); this catches the rest, e.g. a
        controller killed while its argument waited for a worker.
        """
        while True:
            removed = await asyncio.to_thread(shm.cleanup_stale)
            if removed:
                log.info("removed %d shared-memory segment(s) of dead processes", len(removed))
            if await self._sleep(SHM_SWEEP_SECONDS):
                return

    def _stop_unwanted(self, worker_ids: Sequence[str]) -> None:
        known = [w for w in worker_ids if any(m.id == w and m.alive for m in self.spawner.workers())]
        if known:
            log.info("scheduler no longer wants workers %s; stopping them", ", ".join(known))
            task = asyncio.get_running_loop().create_task(self.spawner.stop(known))
            # Keep a reference until done (the loop holds tasks only weakly).
            self._side_tasks.add(task)
            task.add_done_callback(self._side_tasks.discard)

    def _enqueue_report(self, request: scheduler_pb2.ReportWorkerRequest) -> None:
        self._reports.put_nowait(request)

    async def _report_loop(self) -> None:
        """Send worker reports in order, retrying while the scheduler is unreachable."""
        while True:
            request = await self._reports.get()
            backoff = 0.1
            try:
                while True:
                    try:
                        await self._client().call("ReportWorker", request)
                        break
                    except errors.PodiumError as error:
                        if not isinstance(error, RETRYABLE):
                            log.warning("scheduler refused the report on worker %s (%s): %s",
                                        request.worker_id,
                                        common_pb2.WorkerState.Name(request.state), error)
                            break
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
            finally:
                self._reports.task_done()


def _write_json_atomic(path: str, payload: dict) -> None:
    # Readers poll for the file; rename makes it appear complete or not at all.
    write_private_atomic(path, json.dumps(payload))


async def run_agent(config: AgentConfig) -> RunningAgent:
    """Start a node agent in this event loop; returns once it serves.

    Registration happens in the background (``agent.registered`` tells when);
    call ``await agent.stop()`` to end it and its workers.
    """
    token = resolve_token(config.token, config.token_file)
    agent = RunningAgent(config, token)
    try:
        await agent._start()
    except BaseException:
        await agent._close()
        raise
    return agent


async def _serve(config: AgentConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    agent = await run_agent(config)
    await stop.wait()
    log.info("node agent %s: shutting down", agent.node_id)
    await agent.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``podium node``: run a node agent until SIGTERM/SIGINT; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    process.raise_fd_limit()
    try:
        config = config_from_args(args)
        rpc.use_uvloop()
        return asyncio.run(_serve(config))
    except errors.PodiumError as exc:
        print(f"podium node: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


def _physical_memory() -> int:
    """Bytes of physical memory of this machine (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
