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

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import shlex
import signal
import socket
import sys
from typing import Sequence

import grpc

from podium import errors, rpc
from podium.transport import shm
from podium.auth import TlsConfig, resolve_token
from podium.scheduler.client import SchedulerClient
from podium.v1 import common_pb2, node_pb2, node_pb2_grpc, scheduler_pb2
from podium.worker.gpus import DEFAULT_FAKE_MEMORY, GpuProvider, detect, parse_size
from podium.worker.agent.spawner import HEADER_PREFIX, Spawner, read_tail

log = logging.getLogger(__name__)

#: Deadline of each call to the scheduler.
RPC_TIMEOUT_SECONDS = 5.0
#: Heartbeat interval when the scheduler does not say.
DEFAULT_HEARTBEAT_SECONDS = 2.0
#: How long ReservePort holds a port when the request does not say.
DEFAULT_PORT_HOLD_SECONDS = 60.0
#: How often the agent removes shared-memory segments of dead processes.
SHM_SWEEP_SECONDS = 60.0
#: Retry delays towards an unreachable scheduler grow up to this.
MAX_BACKOFF_SECONDS = 5.0
#: How often a following TailLog looks for new lines.
TAIL_POLL_SECONDS = 0.2
#: On shutdown, how long queued reports may take to reach the scheduler.
REPORT_FLUSH_SECONDS = 3.0

#: Errors worth retrying: the scheduler is down or slow, not the request wrong.
_RETRYABLE = (errors.UnavailableError, errors.DeadlineExceededError, errors.CancelledError)


@dataclasses.dataclass
class AgentConfig:
    """Everything ``podium node`` takes on its command line."""

    #: Scheduler address "host:port".
    scheduler: str
    #: Node address: where the agent serves and what it registers (127.0.0.2, ...).
    host: str = "127.0.0.1"
    #: Address to register instead of ``host`` (needed when ``host`` is 0.0.0.0, e.g. in a container).
    advertise_address: str = ""
    #: Agent gRPC port (0: any free one).
    port: int = 0
    #: Node id (default "<hostname>-<host>").
    node_id: str = ""
    #: CPUs offered to bundles (default: os.cpu_count()).
    cpus: float | None = None
    #: Fake this many GPUs (None: ask NVML).
    fake_gpus: int | None = None
    #: Memory of each fake GPU in bytes.
    fake_gpu_memory: int = DEFAULT_FAKE_MEMORY
    #: Where worker logs go (default ~/.podium/logs/<node-id>).
    log_dir: str | None = None
    #: Write {"port", "pid", "node_id", "address"} here once serving.
    port_file: str | None = None
    #: Cluster token (default: resolved as podium.auth.resolve_token says). Never in repr (logs).
    token: str | None = dataclasses.field(default=None, repr=False)
    #: File holding the cluster token.
    token_file: str | None = None
    #: Mutual TLS for the agent's server and its calls to the scheduler.
    tls: TlsConfig | None = None
    #: Default seconds between SIGTERM and SIGKILL.
    stop_grace: float = 5.0
    #: Command that starts a worker ("--ready-fd N" is appended); None: python -m podium.worker.host.
    worker_command: Sequence[str] | None = None
    #: Informational labels sent with the registration.
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Port of the Prometheus /metrics endpoint on ``host`` (None: no endpoint; 0: any free one).
    metrics_port: int | None = None
    #: GPU provider to use instead of detecting one (tests inject patched NVML here).
    provider: GpuProvider | None = None


class PortHolds:
    """Ports bound and held for a later MASTER_PORT (see ``ReservePort``).

    The held socket listens, so nothing else can bind the port, with or without
    SO_REUSEADDR, until it is released right before the worker that needs it starts.
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self._held: dict[int, tuple[socket.socket, asyncio.TimerHandle]] = {}

    def reserve(self, hold_seconds: float) -> int:
        """Bind a free port on the node address and hold it for ``hold_seconds``."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self.host, 0))
            sock.listen(1)
        except OSError as exc:
            sock.close()
            raise errors.UnavailableError(f"cannot bind a port on {self.host}: {exc}") from None
        port = sock.getsockname()[1]
        timer = asyncio.get_running_loop().call_later(hold_seconds, self._expire, port)
        self._held[port] = (sock, timer)
        return port

    def _expire(self, port: int) -> None:
        if self.release(port):
            log.info("port %d: hold expired unclaimed", port)

    def release(self, port: int) -> bool:
        """Close the held socket; False when the port was not held (expired or never)."""
        held = self._held.pop(port, None)
        if held is None:
            return False
        sock, timer = held
        timer.cancel()
        sock.close()
        return True

    def held(self) -> list[int]:
        """Ports held right now."""
        return sorted(self._held)

    def close(self) -> None:
        """Release every hold."""
        for port in list(self._held):
            self.release(port)


class NodeAgentService(node_pb2_grpc.NodeAgentServicer):
    """The ``podium.v1.NodeAgent`` service over one :class:`RunningAgent`."""

    def __init__(self, agent: "RunningAgent") -> None:
        self._agent = agent

    @rpc.handle_errors
    async def SpawnWorkers(self, request, context):
        """Start the workers; the reserved MASTER_PORT is released just before."""
        spawner = self._agent.spawner
        spawner.validate(request.workers)
        if request.reserved_port and not self._agent.ports.release(request.reserved_port):
            log.warning("port %d was not held any more (expired?); spawning anyway",
                        request.reserved_port)
        spawned = await spawner.spawn(request.workers)
        return node_pb2.SpawnWorkersResponse(workers=spawned)

    @rpc.handle_errors
    async def StopWorkers(self, request, context):
        """Stop workers (returns once they are reaped)."""
        stopped = await self._agent.spawner.stop(request.worker_ids, request.grace_seconds)
        return node_pb2.StopWorkersResponse(stopped=stopped)

    @rpc.handle_errors
    async def ReservePort(self, request, context):
        """Hold a free port on the node address."""
        hold = request.hold_seconds
        if hold < 0 or hold != hold:
            raise errors.InvalidArgumentError(f"hold_seconds must be >= 0, got {hold}")
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
        if request.last_lines < 0:
            raise errors.InvalidArgumentError(f"last_lines must be >= 0, got {request.last_lines}")
        followers = []
        try:
            for stream, path in (("stdout", worker.out_path), ("stderr", worker.err_path)):
                end = _size(path)
                if request.last_lines:
                    texts = read_tail(path, request.last_lines, end=end)
                    follower = _Follower(stream, path, end)
                else:
                    # The whole file, read in bounded chunks (a log can be gigabytes).
                    follower = _Follower(stream, path, 0)
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


def _size(path: pathlib.Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class _Follower:
    """Complete lines of a growing log file, from a byte offset on, read in bounded chunks.

    The file stays open between reads (a follower polls every few tenths of a second, for
    every worker a controller streams); :meth:`close` when done."""

    CHUNK = 1 << 20

    def __init__(self, stream: str, path: pathlib.Path, offset: int) -> None:
        self.stream = stream
        self._path = path
        self._offset = offset
        self._partial = b""
        self._handle = None

    def close(self) -> None:
        """Close the file (a later drain opens it again)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def drain(self, *, final: bool = False, until: int | None = None):
        """Yield the lines written since the last call (up to byte ``until``); with
        ``final`` also the last line even without its newline."""
        while until is None or self._offset < until:
            limit = self.CHUNK if until is None else min(self.CHUNK, until - self._offset)
            if self._handle is None:
                try:
                    self._handle = open(self._path, "rb")
                except FileNotFoundError:
                    break
            self._handle.seek(self._offset)
            data = self._handle.read(limit)
            if not data:
                break
            self._offset += len(data)
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()
            yield from self._texts(lines)
        if final and self._partial:
            lines, self._partial = [self._partial], b""
            yield from self._texts(lines)

    @staticmethod
    def _texts(lines: list[bytes]):
        for line in lines:
            text = line.decode("utf-8", errors="replace")
            if not text.startswith(HEADER_PREFIX):
                yield text


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
        self.log_dir = pathlib.Path(config.log_dir or pathlib.Path.home() / ".podium" / "logs" / self.node_id)
        self.provider: GpuProvider = config.provider or detect(
            config.fake_gpus, fake_memory_bytes=config.fake_gpu_memory, node_id=self.node_id)
        self.port = 0
        #: The /metrics server (podium.worker.agent.metrics), when --metrics-port is given.
        self.metrics = None
        self.ports = PortHolds(config.host)
        self.spawner = Spawner(log_dir=self.log_dir, node_id=self.node_id, node_address=self.node_address,
                               scheduler=config.scheduler, token=token, report=self._enqueue_report,
                               command=config.worker_command, stop_grace=config.stop_grace,
                               tls=config.tls)
        #: Set whenever a registration succeeds; cleared when the scheduler is lost.
        self.registered = asyncio.Event()
        #: Successful RegisterNode calls so far (a re-registration adds one).
        self.registrations = 0
        #: Id of the scheduler incarnation last registered with.
        self.scheduler_id = ""
        self._reports: asyncio.Queue[scheduler_pb2.ReportWorkerRequest] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._stopped = asyncio.Event()
        self._stopping = False
        self._server: grpc.aio.Server | None = None
        self._scheduler: SchedulerClient | None = None
        self._tasks: list[asyncio.Task] = []
        self._side_tasks: set[asyncio.Task] = set()

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
            self.metrics = MetricsServer(self)
            await self.metrics.start(self.host, self.config.metrics_port)
        self._scheduler = SchedulerClient(self.config.scheduler, self.token, self.config.tls,
                                          timeout=RPC_TIMEOUT_SECONDS)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._scheduler_loop(), name="agent-heartbeat"),
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
                                   labels=self.config.labels)

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
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

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

    async def _scheduler_loop(self) -> None:
        backoff, outage_logged = 0.1, False
        # Once registered, retry at least as often as it heartbeats: a restarted scheduler
        # must hear from this node well within the node lease it restores.
        max_backoff = MAX_BACKOFF_SECONDS
        while not self._stop.is_set():
            try:
                response = await self._scheduler.register_node(self.node_info(),
                                                               self.spawner.running())
            except errors.PodiumError as error:
                if not outage_logged:
                    # Unreachable is normal (it restarts); a refusal means misconfiguration.
                    level = logging.WARNING if isinstance(error, _RETRYABLE) else logging.ERROR
                    log.log(level, "cannot register with the scheduler (will retry): %s", error)
                    outage_logged = True
                if await self._sleep(backoff):
                    return
                backoff = min(backoff * 2, max_backoff)
                continue
            backoff, outage_logged = 0.1, False
            self.scheduler_id = response.scheduler_id
            self.registrations += 1
            self.registered.set()
            interval = response.heartbeat_interval_seconds or DEFAULT_HEARTBEAT_SECONDS
            max_backoff = min(MAX_BACKOFF_SECONDS, interval)
            log.info("registered node %s with scheduler %s (heartbeat every %g s)",
                     self.node_id, response.scheduler_id or self.config.scheduler, interval)
            await self._heartbeats(interval)
            self.registered.clear()

    async def _heartbeats(self, interval: float) -> None:
        """Heartbeat until the scheduler is lost or wants a new registration."""
        while not await self._sleep(interval):
            try:
                response = await self._scheduler.heartbeat(self.node_id, self._gpus(),
                                                           self._processes(),
                                                           self.spawner.running())
            except errors.PodiumError as error:
                log.warning("heartbeat failed, registering again: %s", error)
                return
            if response.reregister:
                log.info("scheduler asks node %s to register again", self.node_id)
                return
            if response.stop_worker_ids:
                self._stop_unwanted(response.stop_worker_ids)

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
                        await self._scheduler.call("ReportWorker", request)
                        break
                    except errors.PodiumError as error:
                        if not isinstance(error, _RETRYABLE):
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
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, target)


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


def build_parser() -> argparse.ArgumentParser:
    """The ``podium node`` command line."""
    parser = argparse.ArgumentParser(prog="podium node", description="Run a Podium node agent.")
    parser.add_argument("--scheduler", default=os.environ.get("PODIUM_ADDRESS") or None,
                        required=not os.environ.get("PODIUM_ADDRESS"),
                        help="scheduler address HOST:PORT (default: $PODIUM_ADDRESS)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="node address to serve on and register (default 127.0.0.1)")
    parser.add_argument("--advertise-address", default="",
                        help="address to register when --host is not reachable as such "
                             "(e.g. --host 0.0.0.0 in a container; default: --host)")
    parser.add_argument("--port", type=int, default=0, help="agent gRPC port (default: any free)")
    parser.add_argument("--node-id", default="", help="node id (default <hostname>-<node address>)")
    parser.add_argument("--cpus", type=float, default=None, help="CPUs offered (default: all)")
    parser.add_argument("--fake-gpus", type=int, default=None,
                        help="pretend to have N GPUs instead of asking NVML")
    parser.add_argument("--fake-gpu-memory", default="80GiB", help="memory per fake GPU (80GiB)")
    parser.add_argument("--log-dir", default=None,
                        help="worker log directory (default ~/.podium/logs/<node-id>)")
    parser.add_argument("--port-file", default=None,
                        help='write {"port", "pid", "node_id", "address", "metrics_port"} as JSON here once serving')
    parser.add_argument("--token-file", default=None, help="file with the cluster token")
    parser.add_argument("--tls-cert", default=None)
    parser.add_argument("--tls-key", default=None)
    parser.add_argument("--tls-ca", default=None)
    parser.add_argument("--stop-grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when stopping workers (5)")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                        help="informational node label (repeatable)")
    parser.add_argument("--worker-command", default=None,
                        help="advanced: command starting a worker, e.g. a wrapper; "
                             '"--ready-fd N" is appended (default: python -m podium.worker.host)')
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics (token required) on --host at this port "
                             "(0: any free one, written to --port-file; default: none)")
    parser.add_argument("--log-level", default="INFO")
    return parser


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """AgentConfig from parsed ``podium node`` arguments (InvalidArgumentError on bad ones)."""
    labels = {}
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise errors.InvalidArgumentError(f"--label wants KEY=VALUE, got {item!r}")
        labels[key] = value
    if args.stop_grace < 0:
        raise errors.InvalidArgumentError(f"--stop-grace must be >= 0, got {args.stop_grace}")
    return AgentConfig(
        scheduler=args.scheduler, host=args.host, advertise_address=args.advertise_address,
        port=args.port, node_id=args.node_id,
        cpus=args.cpus, fake_gpus=args.fake_gpus, fake_gpu_memory=parse_size(args.fake_gpu_memory),
        log_dir=args.log_dir, port_file=args.port_file, token_file=args.token_file,
        tls=TlsConfig.from_paths(args.tls_cert, args.tls_key, args.tls_ca),
        stop_grace=args.stop_grace, labels=labels, metrics_port=args.metrics_port,
        worker_command=shlex.split(args.worker_command) if args.worker_command else None)


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
    try:
        config = config_from_args(args)
        rpc.use_uvloop()
        return asyncio.run(_serve(config))
    except errors.PodiumError as exc:
        print(f"podium node: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
