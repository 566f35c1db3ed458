"""What the session's own services (the death watch, liveness, the releaser of held results,
the object store) may use of the session they belong to: :class:`SessionCore`.

The full :class:`~podium.controller.session.contract.Session` adds those services
themselves; they take only this part, so no service and the contract import each other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from podium.auth import TlsConfig
    from podium.scheduler.client import SchedulerClient

__all__ = ["SessionCore"]


class SessionCore(Protocol):
    """The loop, the scheduler and the session's identity."""

    #: The scheduler's "host:port".
    address: str
    #: The cluster token every connection carries.
    token: str
    #: Mutual TLS settings for every channel, or None.
    tls: "TlsConfig | None"
    #: The scheduler's id of this session (owner of its placement groups and workers).
    session_id: str
    #: The event loop (on its own thread) every client of this session runs on.
    loop: asyncio.AbstractEventLoop
    #: The scheduler's client.
    scheduler: "SchedulerClient"
    #: Controller-side counters (fetches, bytes fetched, results released).
    stats: dict[str, int]

    @property
    def closed(self) -> bool:
        """Whether the session was shut down."""

    @property
    def embedded(self) -> bool:
        """Whether this session started its own cluster (scheduler and agent children)."""

    def run(self, coro: Coroutine, timeout: float | None = None, *, what: str = "call") -> Any:
        """Run ``coro`` on the loop and wait for it."""
