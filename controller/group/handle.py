"""The per-worker pieces of a WorkerGroup: :class:`WorkerHandle` (one worker process and its
client), the releaser of its held results, and the small helpers the group modules share
(:func:`class_name`, :func:`no_arguments`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from podium.controller.session.calltimeout import effective_call_timeout, plus
from podium.controller.session.runtime import get_runtime


if TYPE_CHECKING:
    from podium.controller.session.contract import Session

__all__ = ["WorkerHandle", "class_name", "no_arguments"]


def class_name(cls: Any) -> str:
    """The name of a hosted class (through Ray's ``__ray_actor_class__`` wrapper)."""
    cls = getattr(cls, "__ray_actor_class__", cls)
    return getattr(cls, "__name__", str(cls))


class WorkerHandle:
    """One worker process of a group (what verl calls the actor handle)."""

    def __init__(self, info: Any, client: Any) -> None:
        #: The scheduler's WorkerInfo (podium.v1) of this worker.
        self.info = info
        #: Its WorkerClient (lives on the runtime's loop).
        self.client = client

    @property
    def rank(self) -> int:
        """Global rank in its group."""
        return self.info.spec.rank

    @property
    def name(self) -> str:
        """Cluster-unique worker name."""
        return self.info.spec.name

    @property
    def worker_id(self) -> str:
        """Scheduler id."""
        return self.info.id

    @property
    def address(self) -> str:
        """host:port of its gRPC server."""
        return f"{self.info.node_address}:{self.info.port}"

    @property
    def node_address(self) -> str:
        """Address of its node."""
        return self.info.node_address

    @property
    def pid(self) -> int:
        """Process id on its node."""
        return self.info.pid

    def held_releaser(self, rt: Session) -> "_HeldReleaser":
        """The callable that releases this worker's held results (made once)."""
        releaser = self.__dict__.get("_held_releaser")
        if releaser is None or releaser._client is not self.client:
            releaser = self._held_releaser = _HeldReleaser(rt, self.client)
        return releaser

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method(*args, **kwargs)`` on this worker only and wait for the value."""
        rt = get_runtime()
        timeout = effective_call_timeout(rt.call_timeout)
        return rt.run(self.client.call(method, args, kwargs, timeout=timeout),
                      timeout=plus(timeout, 5), what=f"{method} on rank {self.rank}")

    def __repr__(self) -> str:
        return f"WorkerHandle(rank={self.rank}, name={self.name!r}, address={self.address!r})"


_NO_ARGUMENTS = None


def no_arguments() -> Any:
    """The encoded ``((), {})`` every argument-less call sends (made once)."""
    global _NO_ARGUMENTS
    if _NO_ARGUMENTS is None:
        from podium.worker.caller.client import prepare
        _NO_ARGUMENTS = prepare(((), {}))
    return _NO_ARGUMENTS


class _HeldReleaser:
    """Drops one worker's held results once their PendingRefs are garbage (fire and forget,
    batched by the runtime's Releaser: one RPC per worker per loop turn)."""

    __slots__ = ("_rt", "_releaser", "_client")

    def __init__(self, rt: Session, client: Any) -> None:
        self._rt = rt
        self._releaser = rt.releaser
        self._client = client

    def __call__(self, object_id: str) -> None:
        if not self._rt.closed:
            self._releaser.add(self._client, object_id)
