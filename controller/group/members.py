"""The workers of one WorkerGroup in rank order, and what verl reads off them (names, world
size, MASTER_ADDR / MASTER_PORT). One :class:`GroupMembers` is shared by a group, its call
object and its views; the building code fills it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from podium.controller.group.handle import WorkerHandle

__all__ = ["GroupMembers"]


class GroupMembers:
    """A group's workers (rank order) and their rendezvous address.

    ``world_size`` and ``names`` count connected workers only: while a group is starting,
    :meth:`reserve` records the workers the scheduler created (so a failed start removes
    them) without making them callable.
    """

    __slots__ = ("workers", "names", "world_size", "master_addr", "master_port", "dead", "broken")

    def __init__(self) -> None:
        #: WorkerHandles in rank order.
        self.workers: list[WorkerHandle] = []
        #: Worker names in rank order.
        self.names: list[str] = []
        #: Number of connected ranks.
        self.world_size = 0
        #: MASTER_ADDR the workers see (rank 0's node), or None.
        self.master_addr: str | None = None
        #: MASTER_PORT the workers see, or None.
        self.master_port: str | None = None
        #: Ranks a call found dead or unresponsive (a group that replaces ranks does so
        #: before its next call).
        self.dead: set[int] = set()
        #: Why the group is broken (a rank's rendezvous failed while the others waited in
        #: it), or None: its calls fail at once until its ranks are replaced.
        self.broken: str | None = None

    def reserve(self, workers: Sequence[WorkerHandle]) -> None:
        """Record created workers that are not connected yet (for teardown only)."""
        self.workers = list(workers)

    def connected(self, workers: Sequence[WorkerHandle], node_is_master: bool = True) -> None:
        """The group runs on ``workers`` (rank order). MASTER_ADDR is rank 0's environment's,
        else (``node_is_master``) rank 0's node address."""
        self.workers = list(workers)
        self.names = [w.name for w in self.workers]
        self.world_size = len(self.workers)
        if self.workers:
            first = self.workers[0]
            env = first.info.env
            fallback = first.node_address if node_is_master else None
            self.master_addr = env.get("MASTER_ADDR") or fallback
            self.master_port = env.get("MASTER_PORT") or None

    def __repr__(self) -> str:
        return f"GroupMembers(world_size={self.world_size}, names={self.names!r})"
