"""What the controller's other rooms may ask of the session: the :class:`Session` protocol.

Groups, actors, tasks, placement groups and the observers take a :class:`Session`, never the
concrete :class:`~podium.controller.session.runtime.Runtime`, so mypy checks every use across
the rooms, and what a room may touch is written here, once. The session's own services (the
death watch, liveness, the releaser, the object store) see only its
:class:`~podium.controller.session.core.SessionCore`, which they are part of. Pending results are settled
through :class:`~podium.worker.caller.pendingcalls.Sink` (``set_result``/``set_exception``), the
public face of a call's outcome.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from podium.controller.session.core import SessionCore

if TYPE_CHECKING:
    from podium.controller.session.deathwatch import DeathWatch
    from podium.controller.session.logdriver import LogToDriver
    from podium.controller.session.objects import ObjectServer
    from podium.controller.session.releaser import Releaser
    from podium.v1 import scheduler_pb2
    from podium.worker.caller.client import WorkerClient

__all__ = ["Session"]


class Session(SessionCore, Protocol):
    """A controller's session with a cluster (one per process): what groups, actors, tasks,
    placement groups and observers may use."""

    #: Default deadline of a blocking call, in seconds (None: none, the default).
    call_timeout: float | None
    #: Deadline of waiting for a placement group or for workers to start.
    placement_timeout: float
    #: Values put here, served from this process.
    objects: "ObjectServer"
    #: Fails the pending calls of workers the scheduler reports dead.
    deathwatch: "DeathWatch"
    #: Batches the release of held results whose refs were dropped.
    releaser: "Releaser"
    #: Worker output streamed to this terminal, or None.
    log_to_driver: "LogToDriver | None"

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule ``coro`` on the loop without waiting."""

    async def cluster_state(self) -> "scheduler_pb2.ClusterState":
        """The scheduler's ClusterState."""

    async def fetch_client(self, address: str) -> "WorkerClient":
        """A started client to the worker at ``address`` (cached)."""

    async def create_placement_groups(self, pool: Any, strategy: str, name: str | None) -> list[Any]:
        """One placement group per pool entry, placed, sorted by node address."""

    def track_pool(self, pool: Any) -> None:
        """Remember a pool with placement groups."""

    def track_group(self, group: Any) -> None:
        """Remember a live WorkerGroup (shut down with the session)."""

    def groups(self) -> list[Any]:
        """The live WorkerGroups of this session."""

    def acquire_pgs(self, user: int, pg_ids: list[str]) -> None:
        """Record that WorkerGroup ``user`` runs in these placement groups."""

    async def release_pgs(self, user: int, pg_ids: list[str]) -> None:
        """Forget ``user``; remove placement groups nobody uses any more."""
