"""Podium's controller SDK: what a single-controller script imports.

``from podium.controller import init, ResourcePool, ClassWithInitArgs, WorkerGroup`` replaces
``ray.init`` and ``verl.single_controller.ray``'s ``RayResourcePool`` / ``RayClassWithInitArgs``
/ ``RayWorkerGroup`` (the Ray names are aliases here), so a verl trainer ports by changing
imports. ``get``/``wait`` are ``ray.get``/``ray.wait`` for the results of ``blocking=False``
calls; ``put``/``remote``/``get_actor``/``kill`` are Ray's object store, tasks and single
actors (:mod:`podium.controller.objects`, :mod:`~podium.controller.tasks`,
:mod:`~podium.controller.actors`). See DESIGN.md section 3 and each module's docstring for where Podium deliberately
differs from verl.
"""

from podium.controller.dispatch import (DISPATCH_MODE_FN_REGISTRY, get_predefined_dispatch_fn,
                                        get_predefined_execute_fn, make_nd_compute_dataproto_dispatch_fn,
                                        register_dispatch_mode, update_dispatch_mode)
from podium.controller.futures import PendingDataProtoFuture, PendingRef, get, wait
from podium.controller.actoroptions import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy
from podium.controller.actors import ActorClass, ActorHandle, get_actor, kill
from podium.controller.group import RayWorkerGroup, WorkerGroup, WorkerHandle
from podium.controller.objects import OwnedRef, put
from podium.controller.pool import (RayResourcePool, ResourcePool, ResourcePoolManager, SubRayResourcePool,
                                    merge_resource_pool, split_resource_pool)
from podium.controller.runtime import init, is_initialized, shutdown
from podium.controller.tasks import RemoteFunction, remote
from podium.refs import DataProtoFuture, ObjectRef
from podium.worker.colocate import (create_colocated_worker_cls, create_colocated_worker_cls_fused,
                                    create_colocated_worker_raw_cls)
from podium.worker.factory import ClassWithInitArgs, RayClassWithInitArgs

__all__ = [
    "init", "shutdown", "is_initialized", "get", "wait",
    "put", "remote", "get_actor", "kill", "ActorClass", "ActorHandle", "RemoteFunction", "OwnedRef",
    "PlacementGroupSchedulingStrategy", "NodeAffinitySchedulingStrategy",
    "ResourcePool", "RayResourcePool", "SubRayResourcePool", "ResourcePoolManager",
    "split_resource_pool", "merge_resource_pool",
    "ClassWithInitArgs", "RayClassWithInitArgs",
    "WorkerGroup", "RayWorkerGroup", "WorkerHandle",
    "create_colocated_worker_cls", "create_colocated_worker_cls_fused", "create_colocated_worker_raw_cls",
    "register_dispatch_mode", "update_dispatch_mode", "get_predefined_dispatch_fn",
    "get_predefined_execute_fn", "make_nd_compute_dataproto_dispatch_fn", "DISPATCH_MODE_FN_REGISTRY",
    "DataProtoFuture", "ObjectRef", "PendingRef", "PendingDataProtoFuture",
]
