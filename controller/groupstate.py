"""The state every part of a :class:`~podium.controller.group.WorkerGroup` shares.

The group is assembled from mixins (building, calls, verl's surface); each reads attributes
that ``WorkerGroup.__init__`` sets and calls methods another mixin defines. This base names
them once, with their types, so each mixin says what it relies on and a type checker can
follow it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from podium.controller.groupworkers import WorkerHandle
    from podium.controller.pool import ResourcePool
    from podium.controller.runtime import Runtime
    from podium.worker.factory import ClassWithInitArgs

__all__ = ["GroupState"]


class GroupState:
    """Attributes of a worker group (set by ``WorkerGroup.__init__``) and the methods its
    parts call on one another."""

    fused_worker_execute_fn_name: str
    _rt: Runtime
    _gid: int
    _is_init_with_detached_workers: bool
    resource_pool: ResourcePool | None
    ray_cls_with_init: ClassWithInitArgs | None
    name_prefix: str
    detached: bool
    use_gpu: bool
    device_name: str
    _workers: list[WorkerHandle]
    _worker_names: list[str]
    _world_size: int
    _dispatch_info: dict[str, list[int]]
    _collect_info: dict[str, list[bool]]
    _master_addr: str | None
    _master_port: str | None
    _owns_workers: bool
    _pg_ids: list[str]
    _closed: bool
    fused_worker_used: bool
    sub_cls_name: str
    method_names: list[str]

    if TYPE_CHECKING:
        def shutdown(self) -> None: ...

        def _run(self, ranks: list[int], method_name: str, per_rank: list[tuple[tuple, dict]],
                 blocking: bool) -> list: ...

        async def _convert(self, worker: WorkerHandle, exc: BaseException, what: str) -> BaseException: ...

        def __getattr__(self, name: str) -> Any: ...  # bound methods of the user's class
