"""The scheduler's record types: sessions, side effects, dirty sets, master plans.

Shared by the tables (:mod:`podium.scheduler.nodes`, ``groups``, ``workers``,
``sessions``) that :class:`~podium.scheduler.state.ClusterModel` composes; plain data,
no state of their own.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field
from fractions import Fraction

from podium.resources import GPU_UNITS
from podium.v1 import common_pb2

__all__ = ["DEFAULT_NODE_LEASE", "LIVE_WORKER_STATES", "TERMINAL_WORKER_STATES", "fraction_text", "Session", "Effects",
           "Dirty", "MasterPlan", "new_id", "RESTORE_GRACE_SECONDS",
           "SPAWN_DEADLINE_SECONDS"]

#: Worker states that hold a slot in their bundle.
LIVE_WORKER_STATES = frozenset({common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING,
                                common_pb2.WORKER_STOPPING})
#: Worker states after which a worker holds nothing.
TERMINAL_WORKER_STATES = frozenset({common_pb2.WORKER_EXITED, common_pb2.WORKER_FAILED})


@functools.lru_cache(maxsize=4096)  # few distinct shares; on every GPU of every /v1/placement page
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

    def expired(self, now: float, since: float = 0.0) -> bool:
        """True when the lease ran out at ``now`` (silence counted from ``since`` at the earliest)."""
        return now - max(self.renewed_at, since) > self.lease_seconds


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


def new_id(prefix: str) -> str:
    """A fresh record id: ``prefix`` and 12 random hex digits."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


#: Seconds without a heartbeat before a node is dead (``--node-lease``). Its agent fences
#: itself ``lease - max(interval, lease / 5)`` after its last answered heartbeat (12 s here),
#: which is also how long an agent may be down and come back to re-adopt its workers: long
#: enough for systemd's or a Kubernetes container's restart.
DEFAULT_NODE_LEASE = 15.0

#: After a restart, how long leases are not enforced (agents and controllers reconnect).
RESTORE_GRACE_SECONDS = 10.0
#: A STARTING worker no agent gave a pid this long after creation fails (the service's
#: SpawnWorkers call times out after 30 s, so a live spawn call always ends first).
SPAWN_DEADLINE_SECONDS = 40.0
