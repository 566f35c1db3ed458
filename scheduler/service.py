"""The Scheduler gRPC service: a thin async shell around :class:`ClusterModel`.

Each RPC validates and mutates the model synchronously (one step of the event loop,
so no lock is needed), writes what changed to the store in one transaction, wakes
the waiters, and only then talks to node agents (reserve a port, spawn, stop).
Waits (WaitPlacementGroup, WaitWorkers) are server-side waits on one
``asyncio.Condition`` that every mutation notifies.

Its parts with a job of their own: the channels to the node agents
(:mod:`~podium.scheduler.agents`), the open heartbeat streams
(:mod:`~podium.scheduler.heartbeats`) and the lease checker (:mod:`~podium.scheduler.leases`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from podium import errors
from podium.auth import TlsConfig
from podium.limits import MAX_GRACE_SECONDS, check_repeated_fields, check_seconds
from podium.rpc import error_from_rpc, handle_errors
from podium.resources import Strategy, validate_bundles
from podium.scheduler import core
from podium.scheduler.agents import AGENT_TIMEOUT, AgentLinks
from podium.scheduler.heartbeats import HeartbeatStreams
from podium.scheduler.leases import LeaseChecker
from podium.scheduler.records import DEFAULT_NODE_LEASE
from podium.scheduler.state import (LIVE_WORKER_STATES, RESTORE_GRACE_SECONDS, ClusterModel, Dirty,
                                    Effects)
from podium.scheduler.store import Store
from podium.scheduler.workerwait import WorkerFeed, died_error
from podium.v1 import common_pb2, node_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["SchedulerConfig", "SchedulerService", "Metrics", "MAX_WAIT_SECONDS", "INLINE_BUNDLES"]

#: Placement groups with at most this many bundles are placed on the event loop itself.
INLINE_BUNDLES = 64
#: Longest a server-side wait may last, whatever the request asks.
MAX_WAIT_SECONDS = 300.0


@dataclass
class SchedulerConfig:
    """Everything a scheduler needs to run (CLI flags map onto these fields)."""

    token: str
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8265
    state: str = ":memory:"
    node_lease: float = DEFAULT_NODE_LEASE
    heartbeat_interval: float = 2.0
    session_lease: float = 30.0
    tls: TlsConfig | None = None
    #: How often the lease checker looks for expired nodes and sessions.
    check_interval: float | None = None
    #: After a restart, seconds before leases apply and unspawned workers fail.
    restore_grace: float = RESTORE_GRACE_SECONDS
    #: Move an existing state file aside (kept as ``<state>.bad-<time>``) and start empty.
    fresh_state: bool = False
    #: Jobs' packages, logs, working dirs ("": jobs/ beside the state file, else a temporary one).
    jobs_dir: str = ""

    def __repr__(self) -> str:  # never print the token
        return (f"SchedulerConfig(host={self.host!r}, port={self.port}, http_port={self.http_port}, "
                f"state={self.state!r}, node_lease={self.node_lease}, "
                f"heartbeat_interval={self.heartbeat_interval}, session_lease={self.session_lease}, "
                f"tls={'on' if self.tls else 'off'})")


class Metrics:
    """Prometheus metrics of one scheduler (own registry: tests run several in one process)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.rpcs = Counter("podium_scheduler_rpcs", "Scheduler RPCs by method and status code",
                            ["method", "code"], registry=self.registry)
        self.latency = Histogram("podium_scheduler_rpc_seconds", "Scheduler RPC latency",
                                 ["method"], registry=self.registry,
                                 buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5,
                                          1, 2.5, 5, 10, 30, 60, 300))
        self.nodes = Gauge("podium_scheduler_nodes", "Registered nodes by state", ["state"],
                           registry=self.registry)
        self.groups = Gauge("podium_scheduler_placement_groups", "Placement groups by state",
                            ["state"], registry=self.registry)
        self.workers = Gauge("podium_scheduler_workers", "Workers by state", ["state"],
                             registry=self.registry)
        self._counters: dict[tuple[str, str], Any] = {}
        self._timers: dict[str, Any] = {}

    def observe(self, method: str, code: str, seconds: float) -> None:
        """Count one RPC and its latency (the labelled children are looked up once each:
        a heartbeat is 1,000 RPCs a second on a 1,000-node cluster)."""
        key = (method, code)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self.rpcs.labels(method=method, code=code)
        timer = self._timers.get(method)
        if timer is None:
            timer = self._timers[method] = self.latency.labels(method=method)
        counter.inc()
        timer.observe(seconds)

    def refresh(self, model: ClusterModel) -> None:
        """Set the state gauges from the model (called on scrape)."""
        for gauge, enum, records, attr in (
                (self.nodes, common_pb2.NodeState, model.nodes.values(), "state"),
                (self.groups, common_pb2.PlacementGroupState, model.groups.values(), "state"),
                (self.workers, common_pb2.WorkerState, model.workers.values(), "state")):
            counts = {name: 0 for name, value in enum.items() if value}
            for record in records:
                counts[enum.Name(getattr(record, attr))] += 1
            for name, count in counts.items():
                gauge.labels(state=name).set(count)


def _metered(method):
    """Count and time an RPC by method and final status code (inside handle_errors)."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context):
        start = time.perf_counter()
        code = "OK"
        try:
            # Every list and map in a request is bounded (podium.limits), checked first.
            check_repeated_fields(request)
            return await method(self, request, context)
        except errors.PodiumError as exc:
            code = exc.code
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            self.metrics.observe(name, code, time.perf_counter() - start)
    return wrapper


def rpc(method):
    """handle_errors + metering, for every Scheduler RPC."""
    return handle_errors(_metered(method))


def _wait_seconds(value: float, context) -> float:
    """The server-side wait for a request: 0 means the cap; never past the call deadline."""
    if not math.isfinite(value) or value < 0:
        raise errors.InvalidArgumentError(f"timeout_seconds = {value!r} must be a finite number >= 0")
    wait = min(value or MAX_WAIT_SECONDS, MAX_WAIT_SECONDS)
    remaining = context.time_remaining() if context is not None else None
    if remaining is not None:
        # Answer with our own DEADLINE_EXCEEDED (which says what is pending) just
        # before the caller's deadline cuts the call.
        wait = min(wait, max(0.0, remaining - 0.05))
    return wait


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """Implements podium.v1.Scheduler over a ClusterModel and a Store."""

    def __init__(self, config: SchedulerConfig, store: Store | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.scheduler_id = f"sched-{uuid.uuid4().hex[:12]}"
        self.model = ClusterModel(node_lease=config.node_lease,
                                  default_session_lease=config.session_lease,
                                  restore_grace=config.restore_grace)
        self.store = store if store is not None else Store(":memory:")
        self.store.load_into(self.model, clock())
        self.metrics = Metrics()
        self._changed = asyncio.Condition()
        self._worker_feed = WorkerFeed()  # what WaitWorkers looks at after each commit
        #: Channels to the node agents; stops workers on them.
        self.agents = AgentLinks(self.model, config.token, config.tls, on_stopped=self._stopped)
        #: Open HeartbeatStream calls (see end_streams).
        self.streams = HeartbeatStreams()
        self.leases = LeaseChecker(self.model, self.streams, clock=clock,
                                   node_lease=config.node_lease, session_lease=config.session_lease,
                                   interval=config.check_interval, settle=self._settle)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the background lease checker (call on the serving loop)."""
        self.leases.start()

    async def close(self) -> None:
        """Stop background work and close agent channels."""
        await self.leases.stop()
        await self.agents.close()
        try:
            self._save_readings()
        except Exception:  # noqa: BLE001 - closing must close the store whatever happens
            log.exception("saving the last heartbeat readings failed")
        self.store.close()

    async def _settle(self, effects: Effects) -> None:
        """Persist a lease check's changes (and the readings gathered), then stop its workers."""
        self._save_readings()
        await self._commit()
        self.agents.stop_later(effects)

    async def _stopped(self, worker_ids: list[str]) -> None:
        """An agent reaped these workers: their slots are free now."""
        self.model.workers.stopped(worker_ids)
        await self._commit()

    async def _commit(self) -> None:
        """Persist what changed and wake the waiters (none when nothing changed: every
        change a waiter waits for marks its record dirty; a heartbeat usually changes none)."""
        dirty = self.model.take_dirty()
        if not dirty:
            return
        self.store.save(self.model, dirty)
        self._worker_feed.record(dirty.workers)
        async with self._changed:
            self._changed.notify_all()

    def _save_readings(self) -> None:
        """Write the heartbeat readings gathered since the last time, in one transaction."""
        readings = self.model.take_readings()
        if readings:
            self.store.save(self.model, Dirty(nodes=readings))

    async def _wait_until(self, ready: Callable[[], bool], seconds: float) -> bool:
        """Wait until ``ready()`` holds (checked after every change); False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        async with self._changed:
            while not ready():
                left = deadline - loop.time()
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    return ready()
        return True

    # ------------------------------------------------------------ node agents

    # ------------------------------------------------------------ node agent RPCs

    @rpc
    async def RegisterNode(self, request, context):
        """A node agent (re)announces itself."""
        effects = self.model.register_node(request.node, request.running, self.clock())
        await self._commit()
        log.info("node %s registered at %s:%d (%d GPUs)", request.node.node_id,
                 request.node.address, request.node.agent_port, len(request.node.gpus))
        self.agents.stop_later(effects)
        return scheduler_pb2.RegisterNodeResponse(
            lease_seconds=self.config.node_lease,
            heartbeat_interval_seconds=self.config.heartbeat_interval,
            scheduler_id=self.scheduler_id)

    @rpc
    async def Heartbeat(self, request, context):
        """Renews a node lease; tells the agent to re-register or to stop stray workers."""
        reregister, stop = self.model.heartbeat(request.node_id, request.gpus, request.processes,
                                                request.running, self.clock())
        await self._commit()
        return scheduler_pb2.HeartbeatResponse(reregister=reregister, stop_worker_ids=stop)

    @handle_errors
    async def HeartbeatStream(self, request_iterator, context):
        """Heartbeat on one long-lived stream: each request answered in order (see the proto).
        Each beat is handled, bounded and metered as a unary Heartbeat is; a bad one ends the
        stream with its error."""
        await self.streams.serve(context, self.Heartbeat)

    async def end_streams(self) -> None:
        """End every open heartbeat stream now with UNAVAILABLE (their agents register again,
        with a restarted scheduler), so that stopping the server waits only for the calls in
        flight, not for streams that never end by themselves. (Cancelling a handler's task
        does not end its call: the server would still wait out its grace.)"""
        await self.streams.end_all(errors.UnavailableError(f"scheduler {self.scheduler_id} is stopping"))

    @rpc
    async def ReportWorker(self, request, context):
        """A worker's state change, from its node agent."""
        self.model.report_worker(request, self.clock())
        await self._commit()
        return scheduler_pb2.ReportWorkerResponse()

    # ------------------------------------------------------------ sessions

    @rpc
    async def OpenSession(self, request, context):
        """Opens a controller session."""
        session = self.model.open_session(request.description, request.lease_seconds, self.clock())
        await self._commit()
        return scheduler_pb2.OpenSessionResponse(session_id=session.id,
                                                 lease_seconds=session.lease_seconds)

    @rpc
    async def KeepAlive(self, request, context):
        """Renews a session lease."""
        alive = self.model.keep_alive(request.session_id, self.clock())
        await self._commit()
        return scheduler_pb2.KeepAliveResponse(alive=alive)

    @rpc
    async def CloseSession(self, request, context):
        """Ends a session and removes what it owns."""
        groups, workers, effects = self.model.close_session(request.session_id, self.clock())
        await self._commit()
        await self.agents.stop_workers(effects)
        return scheduler_pb2.CloseSessionResponse(removed_placement_groups=groups,
                                                  removed_workers=workers)

    async def close_sessions(self, prefix: str) -> int:
        """Close the sessions whose description starts with ``prefix`` (a job's: scheduler.jobs)."""
        ids = [s.id for s in self.model.sessions.values() if s.description.startswith(prefix)]
        for session_id in ids:
            _, _, effects = self.model.close_session(session_id, self.clock())
            await self._commit()
            await self.agents.stop_workers(effects)
        return len(ids)

    # ------------------------------------------------------------ placement groups

    @rpc
    async def CreatePlacementGroup(self, request, context):
        """Creates a group: CREATED, PENDING, or INFEASIBLE at once."""
        bundles = [dict(b.resources) for b in request.bundles]
        if len(bundles) <= INLINE_BUNDLES:
            # A few bundles place in microseconds: a thread hop would cost more (and
            # wait for the GIL behind this loop), so place here, on the kept snapshot.
            group = self.model.create_placement_group(
                request.name, bundles, request.strategy, request.detached, request.owner,
                self.clock())
            await self._commit()
            return group
        # Validating and placing thousands of bundles takes a while: do that pure work on a
        # thread, so heartbeats keep being served (issue #14); applying it stays here.
        specs = await asyncio.to_thread(validate_bundles, bundles)
        snapshot = self.model.snapshot()
        placed = None
        if snapshot.nodes:
            strategy = Strategy.parse(request.strategy)
            placed = (snapshot, await asyncio.to_thread(
                core.place, core.PlacementRequest(specs, strategy), snapshot))
        group = self.model.create_placement_group(
            request.name, bundles, request.strategy, request.detached, request.owner,
            self.clock(), specs=specs, placed=placed)
        await self._commit()
        return group

    @rpc
    async def WaitPlacementGroup(self, request, context):
        """Waits until a group is CREATED."""
        group = self.model.group(request.id)
        seconds = _wait_seconds(request.timeout_seconds, context)
        await self._wait_until(lambda: group.state != common_pb2.PG_PENDING, seconds)
        if group.state == common_pb2.PG_CREATED:
            return group
        if group.state == common_pb2.PG_REMOVED:
            raise errors.FailedPreconditionError(
                f"placement group {group.name!r} was removed: {group.reason}")
        raise errors.DeadlineExceededError(
            f"placement group {group.name!r} still PENDING after {seconds:.1f}s: "
            f"{self.model.pending_text(group)}")

    @rpc
    async def GetPlacementGroup(self, request, context):
        """Looks a group up by id or name."""
        return self.model.group(request.id, request.name)

    @rpc
    async def RemovePlacementGroup(self, request, context):
        """Removes a group and stops its workers."""
        count, effects = self.model.remove_placement_group(request.id, self.clock())
        await self._commit()
        await self.agents.stop_workers(effects)
        return scheduler_pb2.RemovePlacementGroupResponse(removed_workers=count)

    # ------------------------------------------------------------ workers

    @rpc
    async def CreateWorkers(self, request, context):
        """Reserves slots, reserves MASTER_PORT, and has the node agents spawn the workers."""
        plan = self.model.plan_workers(request.specs, request.owner, request.master_rank)
        port = plan.port
        if plan.need_port:
            try:
                reply = await self.agents.stub(plan.node_id).ReservePort(
                    node_pb2.ReservePortRequest(), timeout=AGENT_TIMEOUT)
            except grpc.RpcError as exc:
                raise errors.UnavailableError(
                    f"cannot reserve MASTER_PORT on node {plan.node_id} ({plan.address}): "
                    f"{error_from_rpc(exc)}", node=plan.node_id) from None
            port = reply.port
        # The awaits above let other RPCs run: create_workers validates again.
        workers = self.model.create_workers(request.specs, request.owner, request.master_rank,
                                            port, self.clock())
        await self._commit()
        by_node: dict[str, list[common_pb2.WorkerInfo]] = {}
        for worker in workers:
            by_node.setdefault(worker.node_id, []).append(worker)

        # The master inherits the port's socket, on its node address (podium.worker.masterstore).
        master = next((w.id for w in workers if w.spec.rank == request.master_rank and w.node_id == plan.node_id), "")

        async def spawn(node_id: str, batch: list[common_pb2.WorkerInfo]):
            mine = plan.need_port and node_id == plan.node_id
            reply = await self.agents.stub(node_id).SpawnWorkers(node_pb2.SpawnWorkersRequest(
                workers=batch, reserved_port=port if mine else 0, master_worker_id=master if mine else ""),
                timeout=AGENT_TIMEOUT)
            return node_id, reply

        results = await asyncio.gather(*(spawn(n, b) for n, b in by_node.items()),
                                       return_exceptions=True)
        failed = [(node_id, r) for node_id, r in zip(by_node, results) if isinstance(r, BaseException)]
        if failed:
            node_id, error = failed[0]
            cause = error_from_rpc(error) if isinstance(error, grpc.RpcError) else error
            address = self.model.node(node_id).info.address
            reason = f"spawn failed on node {node_id} ({address}): {cause}"
            effects = self.model.fail_workers([w.id for w in workers], reason)
            await self._commit()
            # Stop what the other agents did start; the failed node gets it too (harmless).
            self.agents.stop_later(effects)
            raise errors.UnavailableError(reason, node=node_id)
        for _, reply in results:
            for spawned in reply.workers:
                if spawned.worker_id in self.model.workers:
                    self.model.mark_spawned(spawned.worker_id, spawned.pid, spawned.log_path)
        await self._commit()
        return scheduler_pb2.CreateWorkersResponse(
            workers=[self.model.worker(w.id) for w in workers])

    @rpc
    async def WaitWorkers(self, request, context):
        """Waits until every listed worker is RUNNING; a dead one fails the wait."""
        workers = [self.model.worker(i) for i in request.ids]
        seconds = _wait_seconds(request.timeout_seconds, context)
        with self._worker_feed.settled(workers) as settled:
            await self._wait_until(settled, seconds)
        for worker in workers:
            if worker.state not in LIVE_WORKER_STATES:
                raise died_error(worker)
        starting = [w for w in workers if w.state != common_pb2.WORKER_RUNNING]
        if starting:
            names = ", ".join(f"{w.spec.name} ({common_pb2.WorkerState.Name(w.state)} on "
                              f"{w.node_id})" for w in starting[:10])
            more = f" and {len(starting) - 10} more" if len(starting) > 10 else ""
            raise errors.DeadlineExceededError(
                f"{len(starting)} of {len(workers)} workers not RUNNING after {seconds:.1f}s: "
                f"{names}{more}")
        return scheduler_pb2.WaitWorkersResponse(workers=workers)

    @rpc
    async def GetWorkers(self, request, context):
        """Looks workers up by ids, names or group."""
        return scheduler_pb2.GetWorkersResponse(
            workers=self.model.get_workers(request.ids, request.names, request.group))

    @rpc
    async def RemoveWorkers(self, request, context):
        """Stops workers and releases their slots."""
        grace = check_seconds(request.grace_seconds, "grace_seconds", MAX_GRACE_SECONDS)
        stopped, effects = self.model.remove_workers(request.ids, self.clock())
        await self._commit()
        await self.agents.stop_workers(effects, grace)
        return scheduler_pb2.RemoveWorkersResponse(stopped=stopped)

    @rpc
    async def AssignWorkers(self, request, context):
        """Hands live workers to a group, rank and world size (a standby taking a rank)."""
        workers = self.model.assign_workers(request.assignments)
        await self._commit()
        return scheduler_pb2.AssignWorkersResponse(workers=workers)

    @rpc
    async def GetClusterState(self, request, context):
        """Everything the scheduler knows."""
        nodes, groups, workers = self.model.cluster_state()
        return scheduler_pb2.ClusterState(scheduler_id=self.scheduler_id, nodes=nodes,
                                          placement_groups=groups, workers=workers)

