"""The verl-compatibility surface of a WorkerGroup: ``execute_all*`` / ``execute_rank_zero*``,
role views (``spawn``, ``spawn_fused``, ``fuse``), the properties verl reads, and the
aliveness check. A mixin of :class:`podium.controller.group.WorkerGroup`."""

from __future__ import annotations

import asyncio
import copy
from typing import TYPE_CHECKING, Any

from podium.controller.groupstate import GroupState
from podium.controller import dispatch as _dispatch
from podium.controller.futures import PendingRef, get as _get
from podium.controller.groupcalls import func_generator
from podium.controller.groupworkers import WorkerHandle

if TYPE_CHECKING:
    from podium.controller.group import WorkerGroup

__all__ = ["GroupVerl"]


class GroupVerl(GroupState):
    """verl's WorkerGroup names over the calls of :class:`GroupCalls` (module docstring)."""

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[PendingRef]:
        """Call ``method_name`` on every rank (verl's slicing rule); a PendingRef per rank."""
        per_rank = _dispatch.slice_for_ranks(self.world_size, args, kwargs)
        return self._run(list(range(self.world_size)), method_name, per_rank, blocking=False)

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """Call ``method_name`` on every rank and wait: the list of values in rank order."""
        per_rank = _dispatch.slice_for_ranks(self.world_size, args, kwargs)
        return self._run(list(range(self.world_size)), method_name, per_rank, blocking=True)

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[PendingRef]:
        """verl's alias of :meth:`execute_all_async`."""
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> PendingRef:
        """Call ``method_name`` on rank 0 only with the arguments as they are."""
        return self._run([0], method_name, [(args, kwargs)], blocking=False)[0]

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method_name`` on rank 0 and wait for the value."""
        return self._run([0], method_name, [(args, kwargs)], blocking=True)[0]

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> PendingRef:
        """verl's alias of :meth:`execute_rank_zero_async`."""
        return self.execute_rank_zero_async(method_name, *args, **kwargs)

    def _view(self) -> "WorkerGroup":
        view: Any = copy.copy(self)
        view._owns_workers = False
        view._pg_ids = []  # the parent holds the placement groups
        view._dispatch_info = {}
        view._collect_info = {}
        return view

    def spawn(self, prefix_set: set[str] | list[str]) -> dict[str, "WorkerGroup"]:
        """One view per role of a colocated class, over the same worker processes.

        In each view, the role's methods are bound unprefixed (``actor.update`` calls
        ``actor_update`` in the worker). No process is started.
        """
        if self.fused_worker_used:
            return self.spawn_fused(prefix_set)
        assert self.ray_cls_with_init is not None, "spawn() needs a group built from a class"
        cls = self.ray_cls_with_init.cls
        role_methods = getattr(cls, "role_methods", None)
        views = {}
        for prefix in prefix_set:
            view = self._view()
            if role_methods is not None and prefix in role_methods:
                table = role_methods[prefix]
            else:  # a class without a role table: verl's prefix match
                table = {attr[len(prefix) + 1:]: attr for attr in dir(view)
                         if attr.startswith(prefix + "_")}
            for method, attr in table.items():
                bound = getattr(self, attr, None)
                if bound is not None:
                    setattr(view, method, bound)
            views[prefix] = view
        return views

    def spawn_fused(self, prefix_set: set[str] | list[str]) -> dict[str, "WorkerGroup"]:
        """Views of a fused class: each binds its role's methods, routed via ``_fuw_execute``."""
        assert self.ray_cls_with_init is not None, "spawn() needs a group built from a class"
        raw = self.ray_cls_with_init.cls.raw_cls_dict
        views = {}
        for key in prefix_set:
            view = self._view()
            view.sub_cls_name = key
            view._bind_worker_method(raw[key], func_generator)
            views[key] = view
        return views

    def fuse(self, prefix_set: set[str] | list[str]) -> None:
        """Set each role's view as an attribute (``wg.actor``, ``wg.critic``)."""
        for role, view in self.spawn(prefix_set).items():
            setattr(self, role, view)

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._world_size

    @property
    def worker_names(self) -> list[str]:
        """Worker names in rank order."""
        return self._worker_names

    @property
    def workers(self) -> list[WorkerHandle]:
        """Worker handles in rank order."""
        return self._workers

    @property
    def master_address(self) -> str | None:
        """MASTER_ADDR the workers see (rank 0's node)."""
        return self._master_addr

    @property
    def master_port(self) -> str | None:
        """MASTER_PORT the workers see."""
        return self._master_port

    def start_worker_aliveness_check(self, every_n_seconds: int = 1) -> None:
        """verl compatibility: check once that every worker answers (UnavailableError if not).

        Podium needs no watcher thread: a worker that dies makes the next (or the pending)
        call fail with WorkerDiedError. verl instead SIGABRTs the whole driver.
        """
        async def describe_all():
            await asyncio.gather(*(w.client.describe(timeout=30) for w in self._workers))

        self._rt.run(describe_all(), timeout=60, what="aliveness check")

    def get(self, refs: Any, timeout: float | None = None) -> Any:
        """Values of refs/futures (same as :func:`podium.controller.get`)."""
        return _get(refs, timeout)
