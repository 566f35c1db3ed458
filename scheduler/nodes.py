"""The node table of the cluster model: registration, heartbeat readings, leases.

What a node's death or return means for the groups and workers on it is the cluster
model's to decide (:class:`~podium.scheduler.state.ClusterModel`); this table holds the
node records and says which nodes' leases ran out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from podium import errors
from podium.resources import parse_custom_resources, sort_key_address
from podium.scheduler.tables import ChangeLog, RecordTable
from podium.v1 import common_pb2

__all__ = ["NodeTable"]


class NodeTable(RecordTable[common_pb2.NodeStatus]):
    """The nodes by id, alive or dead.

    ``changes`` is marked by every change; ``lease`` is the seconds without a heartbeat
    after which a node is overdue. :attr:`capacity_epoch` counts the changes to what the
    alive nodes have (a node came, went or changed its CPUs or GPUs): a capacity snapshot
    taken at one epoch is good until the next.
    """

    def __init__(self, changes: ChangeLog, *, lease: float = 10.0) -> None:
        super().__init__()
        self._changes = changes
        #: Seconds without a heartbeat before a node is overdue (and declared DEAD).
        self.lease = lease
        #: Bumped whenever the capacity of the alive nodes changed.
        self.capacity_epoch = 0
        #: Nodes whose heartbeat readings are not saved yet (see take_readings).
        self._readings: dict[str, None] = {}

    def lookup(self, node_id: str) -> common_pb2.NodeStatus:
        """A node by id, or NotFoundError."""
        node = self._records.get(node_id)
        if node is None:
            raise errors.NotFoundError(f"unknown node {node_id!r}")
        return node

    def alive(self) -> list[common_pb2.NodeStatus]:
        """Alive nodes in address order."""
        alive = [n for n in self._records.values() if n.state == common_pb2.NODE_ALIVE]
        return sorted(alive, key=lambda n: (sort_key_address(n.info.address), n.info.node_id))

    def any_alive(self) -> bool:
        """True when at least one node is alive."""
        return any(n.state == common_pb2.NODE_ALIVE for n in self._records.values())

    def register(self, info: common_pb2.NodeInfo, now: float) -> common_pb2.NodeStatus:
        """Add a node or refresh a known one, ALIVE with a fresh lease (its process readings
        stay until its next heartbeat). Checks everything first: on error nothing changed."""
        if not info.node_id:
            raise errors.InvalidArgumentError("node_id is required")
        if not info.address:
            raise errors.InvalidArgumentError(f"node {info.node_id!r}: address is required")
        if not 0 < info.agent_port < 65536:
            raise errors.InvalidArgumentError(
                f"node {info.node_id!r}: agent_port {info.agent_port} is not a TCP port")
        if not math.isfinite(info.cpus) or info.cpus < 0:
            raise errors.InvalidArgumentError(f"node {info.node_id!r}: cpus = {info.cpus!r} must be >= 0")
        try:
            parse_custom_resources(dict(info.resources), what=f"node {info.node_id!r}: resources")
        except errors.InvalidSpecError as exc:
            raise errors.InvalidArgumentError(exc.message) from None
        indices = [g.index for g in info.gpus]
        if len(set(indices)) != len(indices) or any(i < 0 for i in indices):
            raise errors.InvalidArgumentError(
                f"node {info.node_id!r}: GPU indices {indices} must be distinct and >= 0")
        node = common_pb2.NodeStatus(state=common_pb2.NODE_ALIVE, last_heartbeat=now)
        node.info.CopyFrom(info)
        old = self._records.get(info.node_id)
        if old is not None:
            node.processes.extend(old.processes)
        # An agent re-registering with what it had (after a scheduler restart, a lost
        # heartbeat) keeps the capacity snapshot: a storm of 1,000 must not rebuild it 1,000 times.
        if (old is None or old.state != common_pb2.NODE_ALIVE
                or _capacity_of(old.info) != _capacity_of(info)):
            self.capacity_epoch += 1
        self._records[info.node_id] = node
        self._changes.touch(nodes=[info.node_id])
        return node

    def beat(self, node_id: str, gpus: Sequence[common_pb2.GpuInfo],
             processes: Sequence[common_pb2.ProcessMemory], now: float) -> bool:
        """Renew a node's lease and store its memory readings; False (and nothing changes)
        for an unknown or DEAD node, which must register again."""
        node = self._records.get(node_id)
        if node is None or node.state != common_pb2.NODE_ALIVE:
            return False
        node.last_heartbeat = now
        by_index = {g.index: g for g in gpus}
        for gpu in node.info.gpus:
            fresh = by_index.get(gpu.index)
            if fresh is not None:
                gpu.memory_used_bytes = fresh.memory_used_bytes
                if fresh.memory_total_bytes and fresh.memory_total_bytes != gpu.memory_total_bytes:
                    gpu.memory_total_bytes = fresh.memory_total_bytes
                    self.capacity_epoch += 1  # the snapshot carries each GPU's total
        del node.processes[:]
        node.processes.extend(processes)
        # A heartbeat is frequent and only refreshes readings: they are persisted in
        # batches (take_readings), not one transaction per heartbeat, and wake no waiter.
        self._readings[node_id] = None
        return True

    def take_readings(self) -> dict[str, None]:
        """Ids of the nodes whose heartbeat readings changed since the last call (and forget
        them): the service writes them in one transaction every lease check. A crash loses at
        most those readings; a restored node's lease restarts anyway."""
        readings, self._readings = self._readings, {}
        return readings

    def overdue(self, now: float, since: float) -> list[common_pb2.NodeStatus]:
        """The alive nodes silent for longer than the lease at ``now``, silence counted from
        ``since`` at the earliest."""
        lease = self.lease
        return [n for n in self._records.values()
                if n.state == common_pb2.NODE_ALIVE and now - max(n.last_heartbeat, since) > lease]

    def mark_dead(self, node: common_pb2.NodeStatus) -> None:
        """Declare a node DEAD (its capacity is gone)."""
        node.state = common_pb2.NODE_DEAD
        self.capacity_epoch += 1
        self._changes.touch(nodes=[node.info.node_id])

    def restore(self, nodes: Iterable[common_pb2.NodeStatus], now: float) -> None:
        """Load persisted nodes; the alive ones' leases restart at ``now``."""
        for node in nodes:
            if node.state == common_pb2.NODE_ALIVE:
                node.last_heartbeat = now
            self._records[node.info.node_id] = node
        self.capacity_epoch += 1


def _capacity_of(info: common_pb2.NodeInfo) -> tuple:
    """What of a NodeInfo the capacity snapshot holds (memory used is not)."""
    return (info.address, info.cpus,
            tuple((g.index, g.uuid, g.memory_total_bytes) for g in info.gpus),
            tuple(sorted(info.resources.items())))
