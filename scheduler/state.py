"""The scheduler's in-memory cluster state: pure and synchronous.

:class:`ClusterModel` composes four tables, each an object with its own records and
indexes: the nodes (:class:`~podium.scheduler.nodes.NodeTable`), the placement groups
(:class:`~podium.scheduler.groups.GroupTable`), the workers
(:class:`~podium.scheduler.workers.WorkerTable`) and the controller sessions
(:class:`~podium.scheduler.sessions.SessionTable`). Each is given what it reads (a group
table the nodes and sessions, a worker table the groups and sessions) and the one
:class:`~podium.scheduler.tables.ChangeLog` they all mark. The model applies every request
to them, and decides what one change means for the other tables: a node's death ends its
workers and removes its groups, a session's end removes what it owns, a freed node retries
the pending groups.

It knows no gRPC, no asyncio and no clock: every method that needs time takes ``now``
(Unix seconds), so the unit tests drive it with plain numbers and the service
(podium.scheduler.service) is a thin shell that calls it and then talks to the node agents.

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

from collections.abc import Callable, Iterable, Sequence

from podium.resources import BundleSpec
from podium.scheduler import core
from podium.scheduler.groups import GroupTable, PlaceResult
from podium.scheduler.nodes import NodeTable
from podium.scheduler.records import (DEFAULT_NODE_LEASE, LIVE_WORKER_STATES, RESTORE_GRACE_SECONDS,
                                      SPAWN_DEADLINE_SECONDS, Dirty, Effects, MasterPlan, Session,
                                      fraction_text, new_id)
from podium.scheduler.sessions import SessionTable
from podium.scheduler.tables import ChangeLog
from podium.scheduler.workers import WorkerTable
from podium.v1 import common_pb2, scheduler_pb2

__all__ = ["ClusterModel", "Session", "Effects", "Dirty", "MasterPlan", "LIVE_WORKER_STATES",
           "fraction_text", "RESTORE_GRACE_SECONDS"]


class ClusterModel:
    """The whole scheduler state and every operation on it (see the module docstring)."""

    def __init__(self, *, node_lease: float = DEFAULT_NODE_LEASE, default_session_lease: float = 30.0,
                 max_ended: int = 10_000, new_id: Callable[[str], str] = new_id,
                 restore_grace: float = RESTORE_GRACE_SECONDS,
                 spawn_deadline: float = SPAWN_DEADLINE_SECONDS) -> None:
        #: After a restore, no lease expires for this long (see :meth:`restore`).
        self.restore_grace = restore_grace
        self._quiet_until = 0.0
        #: Leases count silence from here at the earliest (see :meth:`excuse_stall`).
        self._lease_floor = 0.0
        #: How many ended workers (and, separately, removed groups) are remembered.
        self.max_ended = max_ended
        self.changes = ChangeLog()
        self.sessions = SessionTable(self.changes, new_id=new_id,
                                     default_lease=default_session_lease)
        self.nodes = NodeTable(self.changes, lease=node_lease)
        self.groups = GroupTable(self.changes, self.nodes, self.sessions, new_id=new_id)
        self.workers = WorkerTable(self.changes, self.groups, self.sessions, new_id=new_id,
                                   spawn_deadline=spawn_deadline)

    @property
    def version(self) -> int:
        """Bumped by every mutation; waiters compare it to know something changed."""
        return self.changes.version

    def take_dirty(self) -> Dirty:
        """The records changed since the last call (and forget them)."""
        return self.changes.take()

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
        """
        self.nodes.restore(nodes, now)
        self.groups.restore(groups)
        self.workers.restore(workers, unspawned_until=now + self.restore_grace)
        self.sessions.restore(sessions, now)
        if self.sessions or self.nodes.any_alive():
            self._quiet_until = now + self.restore_grace
        self.changes.bump()

    def cluster_state(self) -> tuple[list, list, list]:
        """(nodes, placement groups, workers) as lists of the live records."""
        return list(self.nodes.values()), list(self.groups.values()), list(self.workers.values())

    # ------------------------------------------------------------ lookups

    def node(self, node_id: str) -> common_pb2.NodeStatus:
        """A node by id, or NotFoundError."""
        return self.nodes.lookup(node_id)

    def group(self, group_id: str = "", name: str = "") -> common_pb2.PlacementGroup:
        """A placement group by id or by name (exactly one), or NotFoundError."""
        return self.groups.lookup(group_id, name)

    def worker(self, worker_id: str) -> common_pb2.WorkerInfo:
        """A worker by id, or NotFoundError."""
        return self.workers.lookup(worker_id)

    def session(self, session_id: str) -> Session:
        """An open session, or NotFoundError."""
        return self.sessions.lookup(session_id)

    # ------------------------------------------------------------ nodes and leases

    def register_node(self, info: common_pb2.NodeInfo,
                      running: Sequence[scheduler_pb2.RunningWorker], now: float) -> Effects:
        """Add a node or refresh a known one (its placements stay).

        ``running`` are the workers the agent has alive: known live workers of this
        node get their pid/port; spawned workers of this node the agent no longer
        has are marked EXITED (the agent restarted without them); running workers
        the scheduler does not want are returned in ``Effects.stop``.
        """
        self.nodes.register(info, now)
        effects = self.workers.reconcile(info.node_id, running, registering=True)
        self.groups.promote_pending()
        return effects

    def heartbeat(self, node_id: str, gpus: Sequence[common_pb2.GpuInfo],
                  processes: Sequence[common_pb2.ProcessMemory],
                  running: Sequence[scheduler_pb2.RunningWorker],
                  now: float) -> tuple[bool, list[str]]:
        """Renew a node's lease and store its memory readings.

        Returns ``(reregister, stop_worker_ids)``: reregister is True for an unknown
        or DEAD node (nothing else happens then).
        """
        if not self.nodes.beat(node_id, gpus, processes, now):
            return True, []
        effects = self.workers.reconcile(node_id, running, registering=False)
        return False, effects.stop.get(node_id, [])

    def take_readings(self) -> dict[str, None]:
        """Ids of the nodes whose heartbeat readings changed since the last call (see
        :meth:`NodeTable.take_readings <podium.scheduler.nodes.NodeTable.take_readings>`)."""
        return self.nodes.take_readings()

    def expire(self, now: float) -> Effects:
        """Mark nodes whose lease ran out DEAD and close sessions whose lease ran out.

        A dead node's workers become EXITED ("node X died"); every group with a
        bundle on it is REMOVED with the same reason, and its workers on other nodes
        are stopped. An expired session's non-detached groups and workers go too.
        """
        effects = Effects()
        # Not while a restored cluster is coming back; silence counts from the end of the
        # last scheduler stall at the latest: what a peer sent while the scheduler could not
        # listen was not the peer's silence.
        if now >= self._quiet_until:
            floor = self._lease_floor
            for node in self.nodes.overdue(now, since=floor):
                effects.merge(self.node_died(node, now))
            for session in self.sessions.expired(now, since=floor):
                _, _, more = self._close_session(session, f"session {session.id} lease expired")
                effects.merge(more)
        effects.merge(self.workers.resolve_unspawned(now))
        if effects.stop or self.changes.pending():
            self.groups.promote_pending()
        self.prune()
        return effects

    def excuse_stall(self, now: float) -> None:
        """The scheduler itself was stalled until ``now`` (its loop lagged): restart every
        lease's count of silence at ``now``, so no node or session expires for the
        heartbeats the scheduler could not process meanwhile."""
        self._lease_floor = max(self._lease_floor, now)

    def prune(self) -> None:
        """Forget the oldest ended workers and removed groups beyond ``max_ended`` each.

        They are kept so a controller can still read how a worker ended; a long
        run that creates and removes many worker groups must not grow without bound.
        """
        self.workers.prune(self.max_ended)
        self.groups.prune(self.max_ended)

    def node_died(self, node: common_pb2.NodeStatus, now: float) -> Effects:
        """Declare a node DEAD: its workers end, its groups are removed (and their workers
        on other nodes stopped)."""
        node_id = node.info.node_id
        reason = f"node {node_id} died"
        self.nodes.mark_dead(node)
        self.workers.end_on_node(node_id, reason)
        effects = Effects()
        for group in self.groups.placed_on(node_id):
            _, more = self._remove_group(group, reason)
            effects.merge(more)
        return effects

    # ------------------------------------------------------------ placement groups

    def snapshot(self) -> core.Snapshot:
        """The free capacity of the alive nodes (see :meth:`GroupTable.snapshot
        <podium.scheduler.groups.GroupTable.snapshot>`)."""
        return self.groups.snapshot()

    def create_placement_group(self, name: str, bundles: Sequence[dict], strategy: int,
                               detached: bool, owner: str, now: float, *,
                               specs: tuple[BundleSpec, ...] | None = None,
                               placed: tuple[core.Snapshot, PlaceResult] | None = None
                               ) -> common_pb2.PlacementGroup:
        """Create a group: CREATED, PENDING or InfeasibleError (see :meth:`GroupTable.create
        <podium.scheduler.groups.GroupTable.create>`)."""
        return self.groups.create(name, bundles, strategy, detached, owner, now,
                                  specs=specs, placed=placed)

    def remove_placement_group(self, group_id: str, now: float) -> tuple[int, Effects]:
        """Remove a group and stop its workers; (workers stopped, effects).

        Removing an already removed group is a no-op (0 workers).
        """
        group = self.groups.lookup(group_id)
        if group.state == common_pb2.PG_REMOVED:
            return 0, Effects()
        count, effects = self._remove_group(group, "removed by request")
        self.groups.promote_pending()
        return count, effects

    def _remove_group(self, group: common_pb2.PlacementGroup, reason: str) -> tuple[int, Effects]:
        self.groups.remove(group, reason)
        return self.workers.stop_group(group.id, reason)

    def pending_text(self, group: common_pb2.PlacementGroup) -> str:
        """Why a group is still pending, for a DeadlineExceeded message."""
        return self.groups.pending_text(group)

    # ------------------------------------------------------------ workers

    def get_workers(self, ids: Sequence[str] = (), names: Sequence[str] = (),
                    group: str = "") -> list[common_pb2.WorkerInfo]:
        """Workers by ids, by names or by group (see :meth:`WorkerTable.select
        <podium.scheduler.workers.WorkerTable.select>`)."""
        return self.workers.select(ids, names, group)

    def plan_workers(self, specs: Sequence[common_pb2.WorkerSpec], owner: str,
                     master_rank: int) -> MasterPlan:
        """Validate a CreateWorkers request (no change) and say where the master is."""
        return self.workers.plan(specs, owner, master_rank)

    def create_workers(self, specs: Sequence[common_pb2.WorkerSpec], owner: str,
                       master_rank: int, master_port: int, now: float) -> list[common_pb2.WorkerInfo]:
        """Reserve one slot per spec (all or none) and return the STARTING workers."""
        return self.workers.create(specs, owner, master_rank, master_port, now)

    def mark_spawned(self, worker_id: str, pid: int, log_path: str) -> None:
        """Record the pid and log path the agent gave a just-spawned worker."""
        self.workers.mark_spawned(worker_id, pid, log_path)

    def fail_workers(self, worker_ids: Sequence[str], reason: str) -> Effects:
        """Mark workers FAILED (a spawn that did not happen) and release their slots."""
        return self.workers.fail(worker_ids, reason)

    def report_worker(self, request: scheduler_pb2.ReportWorkerRequest, now: float) -> None:
        """Apply a node agent's report: RUNNING (pid, port) or EXITED/FAILED (exit)."""
        self.workers.report(request)

    def remove_workers(self, worker_ids: Sequence[str], now: float) -> tuple[int, Effects]:
        """Stop workers and release their slots now; (workers that were live, effects)."""
        return self.workers.remove(worker_ids)

    def assign_workers(self, assignments: Sequence[scheduler_pb2.WorkerAssignment]) -> list[common_pb2.WorkerInfo]:
        """Hand live workers to a group, rank and world size (all or none)."""
        return self.workers.assign(assignments)

    # ------------------------------------------------------------ sessions

    def open_session(self, description: str, lease_seconds: float, now: float) -> Session:
        """Open a controller session; lease 0 means the scheduler default (at most an hour)."""
        return self.sessions.open(description, lease_seconds, now)

    def keep_alive(self, session_id: str, now: float) -> bool:
        """Renew a session; False when it is unknown or already expired."""
        return self.sessions.keep_alive(session_id, now)

    def close_session(self, session_id: str, now: float) -> tuple[int, int, Effects]:
        """End a session: remove its non-detached groups and workers.

        Returns (groups removed, workers stopped, effects).
        """
        session = self.sessions.lookup(session_id)
        groups, workers, effects = self._close_session(session, f"session {session_id} closed")
        self.groups.promote_pending()
        return groups, workers, effects

    def _close_session(self, session: Session, reason: str) -> tuple[int, int, Effects]:
        self.sessions.end(session)
        effects = Effects()
        removed_groups = removed_workers = 0
        for group in self.groups.owned_by(session.id):
            count, more = self._remove_group(group, reason)
            removed_groups += 1
            removed_workers += count
            effects.merge(more)
        count, more = self.workers.stop_owned(session.id, reason)
        return removed_groups, removed_workers + count, effects.merge(more)
