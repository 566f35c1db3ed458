"""Nodes of the cluster model: registration, heartbeats, leases, death.

Part of :class:`~podium.scheduler.state.ClusterModel` (a mixin over its shared
dicts); see that module for the rules every mutation follows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from podium import errors
from podium.resources import sort_key_address
from podium.scheduler.records import LIVE_WORKER_STATES, TERMINAL_WORKER_STATES, Effects
from podium.v1 import common_pb2, scheduler_pb2

__all__ = ["NodesMixin"]


class NodesMixin:
    """Node records of the cluster model (``self.nodes``) and their leases."""

    def node(self, node_id: str) -> common_pb2.NodeStatus:
        """A node by id, or NotFoundError."""
        node = self.nodes.get(node_id)
        if node is None:
            raise errors.NotFoundError(f"unknown node {node_id!r}")
        return node

    def alive_nodes(self) -> list[common_pb2.NodeStatus]:
        """Alive nodes in address order."""
        alive = [n for n in self.nodes.values() if n.state == common_pb2.NODE_ALIVE]
        return sorted(alive, key=lambda n: (sort_key_address(n.info.address), n.info.node_id))

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
        # An agent re-registering with what it had (after a scheduler restart, a lost
        # heartbeat) keeps the capacity snapshot: a storm of 1,000 must not rebuild it 1,000 times.
        if (old is None or old.state != common_pb2.NODE_ALIVE
                or _capacity_of(old.info) != _capacity_of(info)):
            self._capacity_changed()
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
            for worker in self.workers_on_node(node_id):
                if (worker.state in LIVE_WORKER_STATES
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
                if fresh.memory_total_bytes and fresh.memory_total_bytes != gpu.memory_total_bytes:
                    gpu.memory_total_bytes = fresh.memory_total_bytes
                    self._capacity_changed()  # the snapshot carries each GPU's total
        del node.processes[:]
        node.processes.extend(processes)
        # A heartbeat is frequent and only refreshes readings: they are persisted in
        # batches (take_readings), not one transaction per heartbeat, and wake no waiter.
        self._readings[node_id] = None
        effects = self._reconcile_running(node_id, running, now, registering=False)
        return False, effects.stop.get(node_id, [])

    def take_readings(self) -> dict[str, None]:
        """Ids of the nodes whose heartbeat readings changed since the last call (and forget
        them): the service writes them in one transaction every lease check. A crash loses at
        most those readings; a restored node's lease restarts anyway."""
        readings, self._readings = self._readings, {}
        return readings

    def expire(self, now: float) -> Effects:
        """Mark nodes whose lease ran out DEAD and close sessions whose lease ran out.

        A dead node's workers become EXITED ("node X died"); every group with a
        bundle on it is REMOVED with the same reason, and its workers on other nodes
        are stopped. An expired session's non-detached groups and workers go too.
        """
        effects = Effects()
        enforce = now >= self._quiet_until  # not while a restored cluster is coming back
        # Silence counts from the end of the last scheduler stall at the latest: what a
        # peer sent while the scheduler could not listen was not the peer's silence.
        floor = self._lease_floor
        for node in list(self.nodes.values()):
            if (enforce and node.state == common_pb2.NODE_ALIVE
                    and now - max(node.last_heartbeat, floor) > self.node_lease):
                effects.merge(self._node_died(node, now))
        for session in list(self.sessions.values()):
            if enforce and session.expired(now, since=floor):
                _, _, more = self._close_session(session, f"session {session.id} lease expired", now)
                effects.merge(more)
        effects.merge(self.resolve_unspawned(now))
        if effects.stop or self._dirty:
            self._promote_pending()
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
        ended = [w.id for w in self.workers.values() if w.state in TERMINAL_WORKER_STATES]
        for worker_id in ended[:max(0, len(ended) - self.max_ended)]:
            self._unindex_worker(self.workers.pop(worker_id))
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
        self._capacity_changed()
        self._touch(nodes=[node_id])
        effects = Effects()
        for worker in self.workers_on_node(node_id):
            if worker.state in LIVE_WORKER_STATES:
                self._end_worker(worker, common_pb2.WORKER_EXITED,
                                 common_pb2.ExitInfo(exit_code=-1, reason=reason))
        for group in list(self.groups.values()):
            if group.state == common_pb2.PG_CREATED and any(p.node_id == node_id for p in group.placements):
                _, more = self._remove_group(group, reason, now)
                effects.merge(more)
        return effects


def _capacity_of(info: common_pb2.NodeInfo) -> tuple:
    """What of a NodeInfo the capacity snapshot holds (memory used is not)."""
    return (info.address, info.cpus,
            tuple((g.index, g.uuid, g.memory_total_bytes) for g in info.gpus))
