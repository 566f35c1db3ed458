"""Podium's controller SDK: resource pools and worker groups (verl's ``single_controller.ray``).

``from podium.controller import ResourcePool, ClassWithInitArgs, WorkerGroup`` replaces
``verl.single_controller.ray``'s ``RayResourcePool`` / ``RayClassWithInitArgs`` /
``RayWorkerGroup`` (the Ray names are aliases here), so a verl trainer ports by changing
imports. The session itself (``init``, ``shutdown``, ``get``, ``wait``, and Ray's ``put``,
``remote``, ``get_actor``, ``kill``: :mod:`~podium.controller.remote.objects`,
:mod:`~podium.controller.remote.tasks`, :mod:`~podium.controller.remote.actors`) and the errors are in the
top-level ``podium`` package; the two scheduling strategies an actor or task takes are here. See ``docs/architecture.md`` and each module's docstring for
where Podium deliberately differs from verl.
"""

from podium.controller.dispatch import (make_nd_compute_dataproto_dispatch_fn, register_dispatch_mode,
                                        update_dispatch_mode)
from podium.controller.group import RayWorkerGroup, WorkerGroup, WorkerHandle
from podium.controller.group.colocate import (create_colocated_worker_cls, create_colocated_worker_cls_fused,
                                              create_colocated_worker_raw_cls)
from podium.controller.pool import (RayResourcePool, ResourcePool, ResourcePoolManager, SubRayResourcePool,
                                    merge_resource_pool, split_resource_pool)
from podium.controller.remote.actoroptions import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy
from podium.worker.factory import ClassWithInitArgs, RayClassWithInitArgs

__all__ = [
    "ClassWithInitArgs",
    "NodeAffinitySchedulingStrategy",
    "PlacementGroupSchedulingStrategy",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourcePool",
    "ResourcePoolManager",
    "SubRayResourcePool",
    "WorkerGroup",
    "WorkerHandle",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
    "make_nd_compute_dataproto_dispatch_fn",
    "merge_resource_pool",
    "register_dispatch_mode",
    "split_resource_pool",
    "update_dispatch_mode",
]
