"""The scheduler's in-memory cluster state: pure and synchronous.

:class:`ClusterModel` holds the nodes, placement groups, workers and controller
sessions, and applies every request to them. It knows no gRPC, no asyncio and no
clock: every method that needs time takes ``now`` (Unix seconds), so the unit tests
drive it with plain numbers and the service (podium.scheduler.service) is a thin
shell that calls it and then talks to the node agents.

Records are the wire messages themselves (``NodeStatus``, ``PlacementGroup``,
``WorkerInfo``), so answering an RPC or persisting a record is a copy.

Rules every mutation follows: validate everything first, then change; on error
nothing changed. Ids and names that are unknown raise :class:`NotFoundError`;
malformed values raise :class:`InvalidArgumentError` / :class:`InvalidSpecError`
naming the value. Each mutation marks what it touched (:meth:`take_dirty`) so the
store can write exactly those records, and returns the side effects the shell
must carry out (:class:`Effects`: which workers to stop on which node).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from podium import errors
from podium.resources import (GPU_UNITS, BundleSpec, Strategy, check_user_env, cpu_units,
                              format_cpus, format_gpus, gpu_units, sort_key_address,
                              system_env, validate_bundles)
from podium.scheduler import core
from podium.v1 import common_pb2, scheduler_pb2

__all__ = ["ClusterModel", "Session", "Effects", "Dirty", "MasterPlan", "LIVE_WORKER_STATES",
           "fraction_text"]

#: Worker states that hold a slot in their bundle.
LIVE_WORKER_STATES = frozenset({common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING,
                                common_pb2.WORKER_STOPPING})
_TERMINAL = frozenset({common_pb2.WORKER_EXITED, common_pb2.WORKER_FAILED})


def fraction_text(units: int, per: int = GPU_UNITS) -> str:
    """Units as an exact fraction for people: ``"1/3"``, ``"1"``, ``"2"``."""
    value = Fraction(units, per)
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


@dataclass
class Session:
    """A controller session: what it creates without ``detached`` dies with it."""

    id: str
    description: str
    lease_seconds: float
    renewed_at: float
    created_at: float

    def expired(self, now: float) -> bool:
        """True when the lease ran out at ``now``."""
        return now - self.renewed_at > self.lease_seconds


@dataclass
class Effects:
    """What the shell must do after a mutation: stop these workers on these nodes."""

    stop: dict[str, list[str]] = field(default_factory=dict)

    def add_stop(self, node_id: str, worker_id: str) -> None:
        """Queue one worker to be stopped on its node."""
        self.stop.setdefault(node_id, []).append(worker_id)

    def merge(self, other: "Effects") -> "Effects":
        """Fold another Effects into this one (returns self)."""
        for node, ids in other.stop.items():
            self.stop.setdefault(node, []).extend(ids)
        return self


@dataclass
class Dirty:
    """Ids of the records changed since the last :meth:`ClusterModel.take_dirty`.

    Each field is an insertion-ordered set (a dict of ids to None) in first-change
    order, which for new records is creation order: the store keeps that order.
    """

    nodes: dict[str, None] = field(default_factory=dict)
    groups: dict[str, None] = field(default_factory=dict)
    workers: dict[str, None] = field(default_factory=dict)
    sessions: dict[str, None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.nodes or self.groups or self.workers or self.sessions)


@dataclass(frozen=True)
class MasterPlan:
    """Where MASTER_ADDR/MASTER_PORT of a CreateWorkers request come from.

    ``need_port`` True: the shell must ask ``node_id``'s agent for a port. False: an
    existing worker of the same group already fixed ``address`` and ``port``.
    """

    node_id: str
    address: str
    port: int
    need_port: bool


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _check_time(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise errors.InvalidArgumentError(f"{name} must be a finite number of seconds, got {value!r}")
    if value < 0:
        raise errors.InvalidArgumentError(f"{name} must be >= 0, got {value!r}")
    return float(value)


#: After a restart, how long leases are not enforced (agents and controllers reconnect).
RESTORE_GRACE_SECONDS = 10.0


class ClusterModel:
    """The whole scheduler state and every operation on it (see the module docstring)."""

    def __init__(self, *, node_lease: float = 10.0, default_session_lease: float = 30.0,
                 max_ended: int = 10_000, new_id: Callable[[str], str] = _new_id,
                 restore_grace: float = RESTORE_GRACE_SECONDS) -> None:
        #: Seconds without a heartbeat before a node is marked DEAD.
        self.node_lease = node_lease
        #: After a restore, no lease expires for this long (see :meth:`restore`).
        self.restore_grace = restore_grace
        self._quiet_until = 0.0
        #: Lease of a session that asks for 0 seconds.
        self.default_session_lease = default_session_lease
        #: How many ended workers (and, separately, removed groups) are remembered.
        self.max_ended = max_ended
        self.nodes: dict[str, common_pb2.NodeStatus] = {}
        # Insertion order is creation order: pending groups are retried in it.
        self.groups: dict[str, common_pb2.PlacementGroup] = {}
        self.workers: dict[str, common_pb2.WorkerInfo] = {}
        self.sessions: dict[str, Session] = {}
        self._specs: dict[str, tuple[BundleSpec, ...]] = {}
        self._new_id = new_id
        self._dirty = Dirty()
        #: Bumped by every mutation; waiters compare it to know something changed.
        self.version = 0

    # ------------------------------------------------------------ bookkeeping

    def take_dirty(self) -> Dirty:
        """The records changed since the last call (and forget them)."""
        dirty, self._dirty = self._dirty, Dirty()
        return dirty

    def _touch(self, *, nodes=(), groups=(), workers=(), sessions=()) -> None:
        self._dirty.nodes.update(dict.fromkeys(nodes))
        self._dirty.groups.update(dict.fromkeys(groups))
        self._dirty.workers.update(dict.fromkeys(workers))
        self._dirty.sessions.update(dict.fromkeys(sessions))
        self.version += 1

    def restore(self, nodes: Iterable[common_pb2.NodeStatus],
                groups: Iterable[common_pb2.PlacementGroup],
                workers: Iterable[common_pb2.WorkerInfo], sessions: Iterable[Session],
                now: float) -> None:
        """Load persisted records (a restarted scheduler). Leases restart at ``now``.

        Alive nodes and open sessions get a fresh lease so their agents and
        controllers can heartbeat again before anything is reclaimed, and nothing
        expires during the first ``restore_grace`` seconds: the agents and controllers
        were retrying with backoff while the scheduler was down, and a lease shorter
        than their next try would declare live nodes dead (and stop their workers).
        Groups must come in creation order.
        """
        for node in nodes:
            if node.state == common_pb2.NODE_ALIVE:
                node.last_heartbeat = now
            self.nodes[node.info.node_id] = node
        for group in sorted(groups, key=lambda g: g.created_at):
            self.groups[group.id] = group
            self._specs[group.id] = validate_bundles([dict(b.resources) for b in group.bundles])
        for worker in workers:
            self.workers[worker.id] = worker
        for session in sessions:
            session.renewed_at = now
            self.sessions[session.id] = session
        if self.sessions or any(n.state == common_pb2.NODE_ALIVE for n in self.nodes.values()):
            self._quiet_until = now + self.restore_grace
        self.version += 1

    # ------------------------------------------------------------ lookups

    def node(self, node_id: str) -> common_pb2.NodeStatus:
        """A node by id, or NotFoundError."""
        node = self.nodes.get(node_id)
        if node is None:
            raise errors.NotFoundError(f"unknown node {node_id!r}")
        return node

    def group(self, group_id: str = "", name: str = "") -> common_pb2.PlacementGroup:
        """A placement group by id or by name (exactly one), or NotFoundError.

        By name, the live (not REMOVED) group wins over removed ones of the same name.
        """
        if bool(group_id) == bool(name):
            raise errors.InvalidArgumentError("give exactly one of placement group id or name")
        if group_id:
            found = self.groups.get(group_id)
            if found is None:
                raise errors.NotFoundError(f"unknown placement group id {group_id!r}")
            return found
        matches = [g for g in self.groups.values() if g.name == name]
        if not matches:
            raise errors.NotFoundError(f"unknown placement group name {name!r}")
        live = [g for g in matches if g.state != common_pb2.PG_REMOVED]
        return (live or matches)[-1]

    def worker(self, worker_id: str) -> common_pb2.WorkerInfo:
        """A worker by id, or NotFoundError."""
        found = self.workers.get(worker_id)
        if found is None:
            raise errors.NotFoundError(f"unknown worker id {worker_id!r}")
        return found

    def get_workers(self, ids: Sequence[str] = (), names: Sequence[str] = (),
                    group: str = "") -> list[common_pb2.WorkerInfo]:
        """Workers by ids, by names (the newest of each name) or by group (rank order).

        Exactly one selector must be given; any unknown id or name is NotFoundError.
        A group lists its live workers (all of them if none is live); an unknown
        group is an empty list.
        """
        given = sum(1 for s in (list(ids), list(names), group) if s)
        if given != 1:
            raise errors.InvalidArgumentError("give exactly one of worker ids, names or group")
        if ids:
            return [self.worker(i) for i in ids]
        if names:
            out = []
            for name in names:
                matches = [w for w in self.workers.values() if w.spec.name == name]
                if not matches:
                    raise errors.NotFoundError(f"unknown worker name {name!r}")
                live = [w for w in matches if w.state in LIVE_WORKER_STATES]
                out.append((live or matches)[-1])
            return out
        members = [w for w in self.workers.values() if w.spec.group == group]
        live = [w for w in members if w.state in LIVE_WORKER_STATES]
        return sorted(live or members, key=lambda w: w.spec.rank)

    def session(self, session_id: str) -> Session:
        """An open session, or NotFoundError."""
        found = self.sessions.get(session_id)
        if found is None:
            raise errors.NotFoundError(f"unknown or expired session {session_id!r}")
        return found

    def alive_nodes(self) -> list[common_pb2.NodeStatus]:
        """Alive nodes in address order."""
        alive = [n for n in self.nodes.values() if n.state == common_pb2.NODE_ALIVE]
        return sorted(alive, key=lambda n: (sort_key_address(n.info.address), n.info.node_id))

    # ------------------------------------------------------------ capacity

    def snapshot(self) -> core.Snapshot:
        """The alive nodes with every CREATED group's reservations taken off."""
        cpu_used: dict[str, int] = {}
        gpu_used: dict[tuple[str, int], int] = {}
        for group in self.groups.values():
            if group.state != common_pb2.PG_CREATED:
                continue
            specs = self._specs[group.id]
            for placed in group.placements:
                spec = specs[placed.bundle_index]
                cpu_used[placed.node_id] = cpu_used.get(placed.node_id, 0) + spec.cpu_units
                if spec.is_fractional:
                    per_gpu = spec.gpu_units
                else:
                    per_gpu = GPU_UNITS
                for index in placed.gpu_indices:
                    key = (placed.node_id, index)
                    gpu_used[key] = gpu_used.get(key, 0) + per_gpu
        views = []
        for node in self.alive_nodes():
            info = node.info
            total_cpu = cpu_units(info.cpus) if math.isfinite(info.cpus) and info.cpus >= 0 else 0
            gpus = tuple(core.GpuView(index=g.index, uuid=g.uuid,
                                      free_units=max(0, GPU_UNITS - gpu_used.get((info.node_id, g.index), 0)),
                                      memory_total_bytes=g.memory_total_bytes)
                         for g in info.gpus)
            views.append(core.NodeView(node_id=info.node_id, address=info.address,
                                       total_cpu_units=total_cpu,
                                       free_cpu_units=max(0, total_cpu - cpu_used.get(info.node_id, 0)),
                                       gpus=gpus))
        return core.Snapshot(tuple(views))

    def _place(self, group: common_pb2.PlacementGroup, snapshot: core.Snapshot):
        return core.place(core.PlacementRequest(self._specs[group.id], Strategy(group.strategy)),
                          snapshot)

    def _apply_placement(self, group: common_pb2.PlacementGroup, placement) -> None:
        del group.placements[:]
        for a in placement.assignments:
            info = self.nodes[a.node_id].info
            uuids = {g.index: g.uuid for g in info.gpus}
            group.placements.add(bundle_index=a.bundle_index, node_id=a.node_id,
                                 node_address=info.address, gpu_indices=list(a.gpu_indices),
                                 gpu_uuids=[uuids.get(i, "") for i in a.gpu_indices])
        group.state = common_pb2.PG_CREATED
        group.reason = ""
        self._touch(groups=[group.id])

    def _promote_pending(self) -> list[str]:
        """Retry pending groups in creation order; ids of those now CREATED."""
        pending = [g for g in self.groups.values() if g.state == common_pb2.PG_PENDING]
        if not pending:
            return []
        created = []
        snapshot = self.snapshot()
        for group in pending:
            if not snapshot.nodes:
                reason = "no alive nodes"
            else:
                result = self._place(group, snapshot)
                if isinstance(result, core.Placement):
                    self._apply_placement(group, result)
                    created.append(group.id)
                    snapshot = self.snapshot()
                    continue
                reason = _reason_text(result)
            if group.reason != reason:
                group.reason = reason
                self._touch(groups=[group.id])
        return created

    # ------------------------------------------------------------ nodes

    def register_node(self, info: common_pb2.NodeInfo,
                      running: Sequence[scheduler_pb2.RunningWorker], now: float) -> Effects:
        """Add a node or refresh a known one (its placements stay).

        ``running`` are the workers the agent has alive: known live workers of this
        node get their pid/port; spawned workers of this node the agent no longer
        has are marked EXITED (the agent restarted without them); running workers
        the scheduler does not want are returned in ``Effects.stop``.
        """
        if not info.node_id:
            raise errors.InvalidArgumentError("node_id is required")
        if not info.address:
            raise errors.InvalidArgumentError(f"node {info.node_id!r}: address is required")
        if not 0 < info.agent_port < 65536:
            raise errors.InvalidArgumentError(
                f"node {info.node_id!r}: agent_port {info.agent_port} is not a TCP port")
        if not math.isfinite(info.cpus) or info.cpus < 0:
            raise errors.InvalidArgumentError(f"node {info.node_id!r}: cpus = {info.cpus!r} must be >= 0")
        indices = [g.index for g in info.gpus]
        if len(set(indices)) != len(indices) or any(i < 0 for i in indices):
            raise errors.InvalidArgumentError(
                f"node {info.node_id!r}: GPU indices {indices} must be distinct and >= 0")
        node = common_pb2.NodeStatus(state=common_pb2.NODE_ALIVE, last_heartbeat=now)
        node.info.CopyFrom(info)
        old = self.nodes.get(info.node_id)
        if old is not None:
            node.processes.extend(old.processes)
        self.nodes[info.node_id] = node
        self._touch(nodes=[info.node_id])
        effects = self._reconcile_running(info.node_id, running, now, registering=True)
        self._promote_pending()
        return effects

    def _reconcile_running(self, node_id: str, running: Sequence[scheduler_pb2.RunningWorker],
                           now: float, *, registering: bool) -> Effects:
        effects = Effects()
        alive_ids = set()
        for item in running:
            alive_ids.add(item.worker_id)
            worker = self.workers.get(item.worker_id)
            if worker is None or worker.node_id != node_id or worker.state not in LIVE_WORKER_STATES:
                effects.add_stop(node_id, item.worker_id)
                continue
            changed = False
            if item.pid and worker.pid != item.pid:
                worker.pid = item.pid
                changed = True
            if item.port and worker.state == common_pb2.WORKER_STARTING:
                worker.port = item.port
                worker.state = common_pb2.WORKER_RUNNING
                changed = True
            if item.HasField("gpu_memory_cap") and worker.gpu_memory_cap != item.gpu_memory_cap:
                worker.gpu_memory_cap.CopyFrom(item.gpu_memory_cap)
                changed = True
            if changed:
                self._touch(workers=[worker.id])
        if registering:
            # A worker the agent spawned (it has a pid) but no longer lists died with
            # the previous agent; one without a pid may still be in an in-flight spawn.
            for worker in self.workers.values():
                if (worker.node_id == node_id and worker.state in LIVE_WORKER_STATES
                        and worker.pid and worker.id not in alive_ids):
                    self._end_worker(worker, common_pb2.WORKER_EXITED, common_pb2.ExitInfo(
                        exit_code=-1, reason=f"not running on node {node_id} after it re-registered"))
        return effects

    def heartbeat(self, node_id: str, gpus: Sequence[common_pb2.GpuInfo],
                  processes: Sequence[common_pb2.ProcessMemory],
                  running: Sequence[scheduler_pb2.RunningWorker],
                  now: float) -> tuple[bool, list[str]]:
        """Renew a node's lease and store its memory readings.

        Returns ``(reregister, stop_worker_ids)``: reregister is True for an unknown
        or DEAD node (nothing else happens then).
        """
        node = self.nodes.get(node_id)
        if node is None or node.state != common_pb2.NODE_ALIVE:
            return True, []
        node.last_heartbeat = now
        by_index = {g.index: g for g in gpus}
        for gpu in node.info.gpus:
            fresh = by_index.get(gpu.index)
            if fresh is not None:
                gpu.memory_used_bytes = fresh.memory_used_bytes
                if fresh.memory_total_bytes:
                    gpu.memory_total_bytes = fresh.memory_total_bytes
        del node.processes[:]
        node.processes.extend(processes)
        # A heartbeat is frequent and only refreshes readings: persist it, but do not
        # wake waiters (version) for it.
        self._dirty.nodes[node_id] = None
        effects = self._reconcile_running(node_id, running, now, registering=False)
        return False, effects.stop.get(node_id, [])

    def expire(self, now: float) -> Effects:
        """Mark nodes whose lease ran out DEAD and close sessions whose lease ran out.

        A dead node's workers become EXITED ("node X died"); every group with a
        bundle on it is REMOVED with the same reason, and its workers on other nodes
        are stopped. An expired session's non-detached groups and workers go too.
        """
        effects = Effects()
        enforce = now >= self._quiet_until  # not while a restored cluster is coming back
        for node in list(self.nodes.values()):
            if (enforce and node.state == common_pb2.NODE_ALIVE
                    and now - node.last_heartbeat > self.node_lease):
                effects.merge(self._node_died(node, now))
        for session in list(self.sessions.values()):
            if enforce and session.expired(now):
                _, _, more = self._close_session(session, f"session {session.id} lease expired", now)
                effects.merge(more)
        if effects.stop or self._dirty:
            self._promote_pending()
        self.prune()
        return effects

    def prune(self) -> None:
        """Forget the oldest ended workers and removed groups beyond ``max_ended`` each.

        They are kept so a controller can still read how a worker ended; a long
        run that creates and removes many worker groups must not grow without bound.
        """
        ended = [w.id for w in self.workers.values() if w.state in _TERMINAL]
        for worker_id in ended[:max(0, len(ended) - self.max_ended)]:
            del self.workers[worker_id]
            self._touch(workers=[worker_id])
        removed = [g.id for g in self.groups.values() if g.state == common_pb2.PG_REMOVED]
        for group_id in removed[:max(0, len(removed) - self.max_ended)]:
            del self.groups[group_id]
            del self._specs[group_id]
            self._touch(groups=[group_id])

    def _node_died(self, node: common_pb2.NodeStatus, now: float) -> Effects:
        node_id = node.info.node_id
        reason = f"node {node_id} died"
        node.state = common_pb2.NODE_DEAD
        self._touch(nodes=[node_id])
        effects = Effects()
        for worker in self.workers.values():
            if worker.node_id == node_id and worker.state in LIVE_WORKER_STATES:
                self._end_worker(worker, common_pb2.WORKER_EXITED,
                                 common_pb2.ExitInfo(exit_code=-1, reason=reason))
        for group in list(self.groups.values()):
            if group.state == common_pb2.PG_CREATED and any(p.node_id == node_id for p in group.placements):
                _, more = self._remove_group(group, reason, now)
                effects.merge(more)
        return effects

    # ------------------------------------------------------------ sessions

    def open_session(self, description: str, lease_seconds: float, now: float) -> Session:
        """Open a controller session; lease 0 means the scheduler default."""
        lease = _check_time(lease_seconds, "lease_seconds") or self.default_session_lease
        session = Session(id=self._new_id("s"), description=description, lease_seconds=lease,
                          renewed_at=now, created_at=now)
        self.sessions[session.id] = session
        self._touch(sessions=[session.id])
        return session

    def keep_alive(self, session_id: str, now: float) -> bool:
        """Renew a session; False when it is unknown or already expired."""
        session = self.sessions.get(session_id)
        if session is None:
            return False
        session.renewed_at = now
        self._dirty.sessions[session_id] = None
        return True

    def close_session(self, session_id: str, now: float) -> tuple[int, int, Effects]:
        """End a session: remove its non-detached groups and workers.

        Returns (groups removed, workers stopped, effects).
        """
        session = self.session(session_id)
        groups, workers, effects = self._close_session(session, f"session {session_id} closed", now)
        self._promote_pending()
        return groups, workers, effects

    def _close_session(self, session: Session, reason: str, now: float) -> tuple[int, int, Effects]:
        del self.sessions[session.id]
        self._touch(sessions=[session.id])
        effects = Effects()
        removed_groups = removed_workers = 0
        for group in list(self.groups.values()):
            if group.owner == session.id and not group.detached and group.state != common_pb2.PG_REMOVED:
                count, more = self._remove_group(group, reason, now)
                removed_groups += 1
                removed_workers += count
                effects.merge(more)
        for worker in self.workers.values():
            if (worker.owner == session.id and not worker.spec.detached
                    and worker.state in LIVE_WORKER_STATES):
                self._stop_worker(worker, reason, effects)
                removed_workers += 1
        return removed_groups, removed_workers, effects

    # ------------------------------------------------------------ placement groups

    def create_placement_group(self, name: str, bundles: Sequence[dict], strategy: int,
                               detached: bool, owner: str, now: float) -> common_pb2.PlacementGroup:
        """Create a group: CREATED when it fits now, PENDING when it fits the cluster
        only once capacity frees; InfeasibleError (with per-node reasons) when no
        set of alive nodes can ever hold it. With no alive node at all it is PENDING.
        """
        if not name:
            raise errors.InvalidArgumentError("placement group name is required")
        specs = validate_bundles(bundles)
        strat = Strategy.parse(strategy)
        if detached:
            owner = ""
        elif owner:
            self.session(owner)
        if any(g.name == name and g.state != common_pb2.PG_REMOVED for g in self.groups.values()):
            raise errors.AlreadyExistsError(f"placement group name {name!r} is already taken")
        group = common_pb2.PlacementGroup(id=self._new_id("pg"), name=name, strategy=int(strat),
                                          state=common_pb2.PG_PENDING, detached=detached,
                                          owner=owner, created_at=now)
        for spec in specs:
            group.bundles.add(resources=spec.to_resources())
        snapshot = self.snapshot()
        if not snapshot.nodes:
            result = None
        else:
            result = core.place(core.PlacementRequest(specs, strat), snapshot)
            if isinstance(result, core.Infeasible):
                raise errors.InfeasibleError(
                    f"placement group {name!r} can never fit: {result.message}",
                    node_reasons=dict(result.node_reasons))
        self.groups[group.id] = group
        self._specs[group.id] = specs
        self._touch(groups=[group.id])
        if isinstance(result, core.Placement):
            self._apply_placement(group, result)
        else:
            group.reason = "no alive nodes" if result is None else _reason_text(result)
        return group

    def remove_placement_group(self, group_id: str, now: float) -> tuple[int, Effects]:
        """Remove a group and stop its workers; (workers stopped, effects).

        Removing an already removed group is a no-op (0 workers).
        """
        group = self.group(group_id)
        if group.state == common_pb2.PG_REMOVED:
            return 0, Effects()
        count, effects = self._remove_group(group, "removed by request", now)
        self._promote_pending()
        return count, effects

    def _remove_group(self, group: common_pb2.PlacementGroup, reason: str,
                      now: float) -> tuple[int, Effects]:
        group.state = common_pb2.PG_REMOVED
        group.reason = reason
        self._touch(groups=[group.id])
        effects = Effects()
        count = 0
        for worker in self.workers.values():
            if worker.spec.placement_group_id == group.id and worker.state in LIVE_WORKER_STATES:
                self._stop_worker(worker, reason, effects)
                count += 1
        return count, effects

    # ------------------------------------------------------------ workers

    def _bundle_usage(self, group_id: str, bundle_index: int) -> tuple[int, int]:
        cpu = gpu = 0
        for worker in self.workers.values():
            spec = worker.spec
            if (spec.placement_group_id == group_id and spec.bundle_index == bundle_index
                    and worker.state in LIVE_WORKER_STATES):
                cpu += _worker_cpu(spec)
                gpu += _worker_gpu(spec)
        return cpu, gpu

    def _validate_specs(self, specs: Sequence[common_pb2.WorkerSpec], owner: str
                        ) -> list[tuple[common_pb2.PlacementGroup, common_pb2.BundlePlacement, int, int]]:
        """Check every spec and every slot; per spec (group, bundle placement, cpu, gpu units)."""
        if not specs:
            raise errors.InvalidArgumentError("CreateWorkers needs at least one worker spec")
        if owner:
            self.session(owner)
        names: set[str] = set()
        ranks: set[tuple[str, int]] = set()
        live_names = {w.spec.name for w in self.workers.values() if w.state in LIVE_WORKER_STATES}
        live_ranks = {(w.spec.group, w.spec.rank) for w in self.workers.values()
                      if w.state in LIVE_WORKER_STATES}
        wanted: dict[tuple[str, int], list[int]] = {}
        out = []
        for i, spec in enumerate(specs):
            label = f"worker spec {i} ({spec.name!r})"
            if not spec.name:
                raise errors.InvalidArgumentError(f"worker spec {i}: name is required")
            if spec.name in names:
                raise errors.InvalidArgumentError(f"{label}: name given twice in one request")
            if spec.name in live_names:
                raise errors.AlreadyExistsError(f"worker name {spec.name!r} is already taken")
            names.add(spec.name)
            if not spec.group:
                raise errors.InvalidArgumentError(f"{label}: group (WG_PREFIX) is required")
            if spec.world_size < 1:
                raise errors.InvalidArgumentError(f"{label}: world_size = {spec.world_size} must be >= 1")
            if not 0 <= spec.rank < spec.world_size:
                raise errors.InvalidArgumentError(
                    f"{label}: rank = {spec.rank} must be in [0, world_size={spec.world_size})")
            key = (spec.group, spec.rank)
            if key in ranks or key in live_ranks:
                raise errors.InvalidArgumentError(
                    f"{label}: rank {spec.rank} of group {spec.group!r} is already taken")
            ranks.add(key)
            try:
                check_user_env(dict(spec.env))
                gpu = 0 if spec.num_gpus == 0 else gpu_units(spec.num_gpus, name=f"{label}: num_gpus")
                cpu = cpu_units(spec.num_cpus, name=f"{label}: num_cpus")
            except errors.InvalidSpecError as exc:
                raise errors.InvalidSpecError(exc.message if label in exc.message
                                              else f"{label}: {exc.message}") from None
            if not spec.placement_group_id:
                raise errors.InvalidArgumentError(f"{label}: placement_group_id is required")
            group = self.groups.get(spec.placement_group_id)
            if group is None:
                raise errors.NotFoundError(
                    f"{label}: unknown placement group id {spec.placement_group_id!r}")
            if group.state != common_pb2.PG_CREATED:
                state = common_pb2.PlacementGroupState.Name(group.state)
                raise errors.FailedPreconditionError(
                    f"{label}: placement group {group.name!r} is {state}, not PG_CREATED"
                    + (f" ({group.reason})" if group.reason else ""))
            if not 0 <= spec.bundle_index < len(group.bundles):
                raise errors.InvalidArgumentError(
                    f"{label}: bundle_index = {spec.bundle_index} out of range "
                    f"(group {group.name!r} has {len(group.bundles)} bundles)")
            bundle = self._specs[group.id][spec.bundle_index]
            if gpu and not bundle.gpu_units:
                raise errors.InvalidSpecError(
                    f"{label}: num_gpus = {spec.num_gpus!r} but bundle {spec.bundle_index} of "
                    f"{group.name!r} has no GPU")
            placed = next(p for p in group.placements if p.bundle_index == spec.bundle_index)
            wanted.setdefault((group.id, spec.bundle_index), []).append(i)
            out.append((group, placed, cpu, gpu))
        for (group_id, index), members in wanted.items():
            bundle = self._specs[group_id][index]
            used_cpu, used_gpu = self._bundle_usage(group_id, index)
            need_cpu = sum(out[i][2] for i in members)
            need_gpu = sum(out[i][3] for i in members)
            if used_cpu + need_cpu > bundle.cpu_units or used_gpu + need_gpu > bundle.gpu_units:
                name = self.groups[group_id].name
                raise errors.SlotFullError(
                    f"bundle {index} of placement group {name!r} is full: it holds "
                    f"{bundle.describe()}, workers already use CPU {format_cpus(used_cpu)} / "
                    f"GPU {format_gpus(used_gpu)}, and {len(members)} more ask for "
                    f"CPU {format_cpus(need_cpu)} / GPU {format_gpus(need_gpu)}")
        return out

    def plan_workers(self, specs: Sequence[common_pb2.WorkerSpec], owner: str,
                     master_rank: int) -> MasterPlan:
        """Validate a CreateWorkers request (no change) and say where the master is.

        The master is the spec with ``rank == master_rank``; when no spec has it, an
        existing live worker of the same group with that rank provides MASTER_ADDR
        and MASTER_PORT (workers created in several calls).
        """
        return self._plan(specs, self._validate_specs(specs, owner), master_rank)

    def _plan(self, specs, checked, master_rank: int) -> MasterPlan:
        for spec, (_, placed, _, _) in zip(specs, checked):
            if spec.rank == master_rank:
                return MasterPlan(placed.node_id, placed.node_address, 0, True)
        groups = {s.group for s in specs}
        for worker in self.workers.values():
            if (worker.spec.group in groups and worker.spec.rank == master_rank
                    and worker.state in LIVE_WORKER_STATES):
                env = worker.env
                return MasterPlan(worker.node_id, env.get("MASTER_ADDR", worker.node_address),
                                  int(env.get("MASTER_PORT", "0") or 0), False)
        raise errors.InvalidArgumentError(
            f"master_rank = {master_rank}: no spec and no live worker of group(s) "
            f"{sorted(groups)} has that rank")

    def create_workers(self, specs: Sequence[common_pb2.WorkerSpec], owner: str,
                       master_rank: int, master_port: int, now: float) -> list[common_pb2.WorkerInfo]:
        """Reserve one slot per spec (all or none) and return the STARTING workers.

        A full slot raises SlotFullError at once. Each worker's env is the system env
        (podium.resources.system_env) plus its spec.env.
        """
        checked = self._validate_specs(specs, owner)
        plan = self._plan(specs, checked, master_rank)
        port = plan.port if not plan.need_port else master_port
        if not 0 < port < 65536:
            raise errors.InvalidArgumentError(f"master_port = {port} is not a TCP port")
        created = []
        for spec, (group, placed, _, gpu) in zip(specs, checked):
            worker = common_pb2.WorkerInfo(id=self._new_id("w"), node_id=placed.node_id,
                                           node_address=placed.node_address,
                                           state=common_pb2.WORKER_STARTING,
                                           owner="" if spec.detached else owner)
            worker.spec.CopyFrom(spec)
            if gpu:
                worker.gpu_indices.extend(placed.gpu_indices)
            created.append(worker)
        for worker in created:
            self.workers[worker.id] = worker
        for worker in created:
            spec = worker.spec
            local = sum(1 for w in self.workers.values()
                        if w.spec.group == spec.group and w.node_id == worker.node_id
                        and w.state in LIVE_WORKER_STATES)
            env = system_env(rank=spec.rank, world_size=spec.world_size, master_addr=plan.address,
                             master_port=port, gpu_indices=list(worker.gpu_indices),
                             group=spec.group, local_world_size=local, worker_id=worker.id,
                             node_address=worker.node_address)
            # As Ray does: a worker's math libraries use as many threads as it has CPUs
            # (its spec.env may say otherwise). Unset, every worker of a node starts one
            # OpenMP thread per core, and their spinning threads slow each other down
            # (measured: a 1 MiB DP_COMPUTE_PROTO on 4 CPU workers, 28.6 ms -> 4.2 ms).
            worker.env["OMP_NUM_THREADS"] = str(max(1, int(spec.num_cpus)))
            worker.env.update(dict(spec.env))
            worker.env.update(env)
        self._touch(workers=[w.id for w in created])
        return created

    def mark_spawned(self, worker_id: str, pid: int, log_path: str) -> None:
        """Record the pid and log path the agent gave a just-spawned worker."""
        worker = self.worker(worker_id)
        if pid and not worker.pid:
            worker.pid = pid
        if log_path:
            worker.log_path = log_path
        self._touch(workers=[worker_id])

    def fail_workers(self, worker_ids: Sequence[str], reason: str) -> Effects:
        """Mark workers FAILED (a spawn that did not happen) and release their slots."""
        effects = Effects()
        for worker_id in worker_ids:
            worker = self.worker(worker_id)
            if worker.state in LIVE_WORKER_STATES:
                self._end_worker(worker, common_pb2.WORKER_FAILED,
                                 common_pb2.ExitInfo(exit_code=-1, reason=reason, requested=True))
                effects.add_stop(worker.node_id, worker_id)
        return effects

    def report_worker(self, request: scheduler_pb2.ReportWorkerRequest, now: float) -> None:
        """Apply a node agent's report: RUNNING (pid, port) or EXITED/FAILED (exit).

        Reports about a worker already ended are ignored (a stop we asked for);
        the heartbeat then tells the agent to stop anything still alive.
        """
        worker = self.worker(request.worker_id)
        if request.node_id and request.node_id != worker.node_id:
            raise errors.InvalidArgumentError(
                f"worker {worker.id!r} runs on node {worker.node_id!r}, not {request.node_id!r}")
        state = request.state
        if state == common_pb2.WORKER_RUNNING:
            if not 0 < request.port < 65536:
                raise errors.InvalidArgumentError(
                    f"worker {worker.id!r}: RUNNING needs its port, got {request.port}")
            if worker.state in (common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING):
                worker.state = common_pb2.WORKER_RUNNING
                worker.port = request.port
                if request.pid:
                    worker.pid = request.pid
                if request.HasField("gpu_memory_cap"):
                    worker.gpu_memory_cap.CopyFrom(request.gpu_memory_cap)
                self._touch(workers=[worker.id])
        elif state in _TERMINAL:
            if worker.state in LIVE_WORKER_STATES:
                if request.pid:
                    worker.pid = request.pid
                self._end_worker(worker, state, request.exit)
            elif worker.exit.requested and request.HasField("exit"):
                # Keep "requested" but learn how the stopped process actually ended.
                worker.exit.exit_code = request.exit.exit_code
                worker.exit.signal = request.exit.signal
                if request.exit.stderr_tail:
                    worker.exit.stderr_tail = request.exit.stderr_tail
                self._touch(workers=[worker.id])
        elif state == common_pb2.WORKER_STOPPING:
            if worker.state in LIVE_WORKER_STATES:
                worker.state = common_pb2.WORKER_STOPPING
                self._touch(workers=[worker.id])
        else:
            name = common_pb2.WorkerState.Name(state) if state in common_pb2.WorkerState.values() else state
            raise errors.InvalidArgumentError(f"worker {worker.id!r}: cannot report state {name}")

    def remove_workers(self, worker_ids: Sequence[str], now: float) -> tuple[int, Effects]:
        """Stop workers and release their slots now; (workers that were live, effects)."""
        workers = [self.worker(i) for i in worker_ids]
        effects = Effects()
        stopped = 0
        for worker in workers:
            if worker.state in LIVE_WORKER_STATES:
                self._stop_worker(worker, "stopped by request", effects)
                stopped += 1
        return stopped, effects

    def _stop_worker(self, worker: common_pb2.WorkerInfo, reason: str, effects: Effects) -> None:
        self._end_worker(worker, common_pb2.WORKER_EXITED,
                         common_pb2.ExitInfo(exit_code=-1, reason=reason, requested=True))
        effects.add_stop(worker.node_id, worker.id)

    def _end_worker(self, worker: common_pb2.WorkerInfo, state: int,
                    exit_info: common_pb2.ExitInfo) -> None:
        # The slot is free as soon as the state is terminal (usage is computed from
        # live workers), so a replacement can be created right away.
        worker.state = state
        worker.exit.CopyFrom(exit_info)
        self._touch(workers=[worker.id])

    # ------------------------------------------------------------ waits

    def pending_text(self, group: common_pb2.PlacementGroup) -> str:
        """Why a group is still pending, for a DeadlineExceeded message."""
        return group.reason or "waiting for capacity"

    def cluster_state(self) -> tuple[list, list, list]:
        """(nodes, placement groups, workers) as lists of the live records."""
        return list(self.nodes.values()), list(self.groups.values()), list(self.workers.values())


def _worker_cpu(spec: common_pb2.WorkerSpec) -> int:
    return cpu_units(spec.num_cpus) if spec.num_cpus else 0


def _worker_gpu(spec: common_pb2.WorkerSpec) -> int:
    return gpu_units(spec.num_gpus) if spec.num_gpus else 0


def _reason_text(result) -> str:
    reasons = "; ".join(f"{node}: {why}" for node, why in sorted(result.node_reasons.items()))
    return f"{result.message} ({reasons})" if reasons else result.message
