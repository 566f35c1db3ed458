"""Role views of a WorkerGroup (verl's ``spawn``): views over the same worker processes that
bind one role's methods of a colocated class unprefixed. A view is a shallow copy of its
group with its own mesh caches and call object; it owns neither workers nor placement groups.
A fused class's views route their role's methods through the fused worker's dispatcher
(:class:`FusedRoute`)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any, Protocol, TypeVar

from podium.controller.group.binding import bind_worker_methods, func_generator
from podium.errors import InvalidArgumentError

__all__ = ["FusedRoute", "ViewableGroup", "make_view", "spawn", "spawn_fused"]


class ViewableGroup(Protocol):
    """What a view is made from: the WorkerGroup attributes this module reads and sets (a
    protocol, so the group's module is imported by this one and not the other way round)."""

    ray_cls_with_init: Any
    fused_worker_used: bool
    fused_worker_execute_fn_name: str
    sub_cls_name: str
    _calls: Any
    _owns_workers: bool
    _pg_ids: list[str]
    _dispatch_info: dict[str, list[int]]
    _collect_info: dict[str, list[bool]]


G = TypeVar("G", bound=ViewableGroup)

#: The fused worker's dispatcher of synchronous role methods (verl's name).
FUSED_EXECUTE = "_fuw_execute"
#: ... and of coroutine role methods.
FUSED_EXECUTE_ASYNC = "_fuw_execute_async"


class FusedRoute:
    """What a fused class's role view asks its workers to run: a role method becomes a call
    of the fused worker's dispatcher, a method of the fused class itself goes as it is."""

    __slots__ = ("role", "_role_cls", "_own_names", "_execute")

    def __init__(self, fused_cls: Any, role: str, execute: str = FUSED_EXECUTE) -> None:
        #: The role (the key of the fused class's ``raw_cls_dict``).
        self.role = role
        self._role_cls = getattr(fused_cls, "raw_cls_dict", {}).get(role)
        self._own_names = frozenset(dir(fused_cls))
        self._execute = execute

    def __call__(self, method_name: str, args: tuple) -> tuple[str, tuple]:
        if method_name in self._own_names:
            return method_name, tuple(args)
        target = getattr(self._role_cls, method_name, None)
        fn = FUSED_EXECUTE_ASYNC if asyncio.iscoroutinefunction(target) else self._execute
        return fn, (f"{self.role}_fwmn_{method_name}",) + tuple(args)


def make_view(group: G) -> G:
    """A view of ``group``: the same workers, its own mesh caches and call object."""
    view = copy.copy(group)
    view._owns_workers = False
    view._pg_ids = []  # the parent holds the placement groups
    view._dispatch_info = {}
    view._collect_info = {}
    view._calls = group._calls.routed()
    return view


def _hosted_class(group: ViewableGroup) -> Any:
    if group.ray_cls_with_init is None:
        raise InvalidArgumentError("spawn() needs a group built from a class (ray_cls_with_init)")
    return group.ray_cls_with_init.cls


def spawn(group: G, prefix_set: Any) -> dict[str, G]:
    """One view per role prefix of a colocated class (see :meth:`WorkerGroup.spawn`)."""
    if group.fused_worker_used:
        return spawn_fused(group, prefix_set)
    role_methods = getattr(_hosted_class(group), "role_methods", None)
    views = {}
    for prefix in prefix_set:
        view = make_view(group)
        if role_methods is not None and prefix in role_methods:
            table = role_methods[prefix]
        else:  # a class without a role table: verl's prefix match
            table = {attr[len(prefix) + 1:]: attr for attr in dir(view) if attr.startswith(prefix + "_")}
        for method, attr in table.items():
            bound = getattr(group, attr, None)
            if bound is not None:
                setattr(view, method, bound)
        views[prefix] = view
    return views


def spawn_fused(group: G, prefix_set: Any) -> dict[str, G]:
    """Views of a fused class: each binds its role's methods, routed via ``_fuw_execute``."""
    cls = _hosted_class(group)
    raw = cls.raw_cls_dict
    views = {}
    for key in prefix_set:
        view = make_view(group)
        view.sub_cls_name = key
        view._calls = group._calls.routed(FusedRoute(cls, key, group.fused_worker_execute_fn_name))
        bind_worker_methods(view, raw[key], func_generator)
        views[key] = view
    return views
