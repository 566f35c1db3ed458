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

The operations live by aggregate in :mod:`~podium.scheduler.nodes`,
:mod:`~podium.scheduler.groups`, :mod:`~podium.scheduler.workers` (with
:mod:`~podium.scheduler.workerspecs`) and :mod:`~podium.scheduler.sessions`;
the record types in :mod:`~podium.scheduler.records`. This module composes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from podium.resources import BundleSpec, validate_bundles
from podium.scheduler.groups import GroupsMixin
from podium.scheduler.nodes import NodesMixin
from podium.scheduler.records import (LIVE_WORKER_STATES, RESTORE_GRACE_SECONDS,
                                      SPAWN_DEADLINE_SECONDS, Dirty, Effects, MasterPlan, Session,
                                      fraction_text, new_id)
from podium.scheduler.sessions import SessionsMixin
from podium.scheduler.workers import WorkersMixin
from podium.v1 import common_pb2

__all__ = ["ClusterModel", "Session", "Effects", "Dirty", "MasterPlan", "LIVE_WORKER_STATES",
           "fraction_text", "RESTORE_GRACE_SECONDS"]


class ClusterModel(NodesMixin, GroupsMixin, WorkersMixin, SessionsMixin):
    """The whole scheduler state and every operation on it (see the module docstring)."""

    def __init__(self, *, node_lease: float = 10.0, default_session_lease: float = 30.0,
                 max_ended: int = 10_000, new_id: Callable[[str], str] = new_id,
                 restore_grace: float = RESTORE_GRACE_SECONDS,
                 spawn_deadline: float = SPAWN_DEADLINE_SECONDS) -> None:
        #: Seconds without a heartbeat before a node is marked DEAD.
        self.node_lease = node_lease
        #: After a restore, no lease expires for this long (see :meth:`restore`).
        self.restore_grace = restore_grace
        self._quiet_until = 0.0
        #: A STARTING worker without a pid this long after creation has failed to spawn.
        self.spawn_deadline = spawn_deadline
        #: Worker id -> when it fails unless an agent gave it a pid (resolve_unspawned).
        self._unspawned: dict[str, float] = {}
        #: Leases count silence from here at the earliest (see :meth:`excuse_stall`).
        self._lease_floor = 0.0
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
        #: The free capacity of the alive nodes, kept up to date (see :meth:`snapshot`);
        #: None: rebuild on next use.
        self._capacity = None
        #: Name -> id of the live (not REMOVED) group of that name.
        self._live_names: dict[str, str] = {}
        #: Group id / node id -> ids of the workers in it / on it (insertion-ordered sets):
        #: what a removal, a registration or a slot check looks at, instead of every worker.
        self._group_workers: dict[str, dict[str, None]] = {}
        self._node_workers: dict[str, dict[str, None]] = {}
        self._new_id = new_id
        self._dirty = Dirty()
        #: Nodes whose heartbeat readings are not saved yet (see take_readings).
        self._readings: dict[str, None] = {}
        #: Bumped by every mutation; waiters compare it to know something changed.
        self.version = 0

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
            if group.state != common_pb2.PG_REMOVED:
                self._live_names[group.name] = group.id
        for worker in workers:
            self.workers[worker.id] = worker
            self._index_worker(worker)
            if worker.state == common_pb2.WORKER_STARTING and not worker.pid:
                # Its spawn died with the previous scheduler unless its agent lists it.
                self._unspawned[worker.id] = now + self.restore_grace
        for session in sessions:
            session.renewed_at = now
            self.sessions[session.id] = session
        if self.sessions or any(n.state == common_pb2.NODE_ALIVE for n in self.nodes.values()):
            self._quiet_until = now + self.restore_grace
        self.version += 1

    def _index_worker(self, worker: common_pb2.WorkerInfo) -> None:
        """Add a new worker to the by-group and by-node indexes."""
        self._group_workers.setdefault(worker.spec.placement_group_id, {})[worker.id] = None
        self._node_workers.setdefault(worker.node_id, {})[worker.id] = None

    def _unindex_worker(self, worker: common_pb2.WorkerInfo) -> None:
        """Drop a forgotten worker from the indexes."""
        for index, key in ((self._group_workers, worker.spec.placement_group_id),
                           (self._node_workers, worker.node_id)):
            members = index.get(key)
            if members is not None:
                members.pop(worker.id, None)
                if not members:
                    del index[key]

    def workers_of_group(self, group_id: str) -> list[common_pb2.WorkerInfo]:
        """Every remembered worker of a placement group, in creation order."""
        return [self.workers[i] for i in self._group_workers.get(group_id, ())]

    def workers_on_node(self, node_id: str) -> list[common_pb2.WorkerInfo]:
        """Every remembered worker of a node, in creation order."""
        return [self.workers[i] for i in self._node_workers.get(node_id, ())]

    def cluster_state(self) -> tuple[list, list, list]:
        """(nodes, placement groups, workers) as lists of the live records."""
        return list(self.nodes.values()), list(self.groups.values()), list(self.workers.values())
