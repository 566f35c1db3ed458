"""``WorkerGroup`` (verl's ``RayWorkerGroup``): N worker processes driven as one object.

Building a group reserves its pool's placement groups, asks the scheduler for one worker
process per bundle slot (rank order = node address order), connects to every worker,
constructs the user class in each (concurrently), then binds every ``@register``'ed method
of the class onto the group. Calling a bound method runs verl's pipeline: dispatch ->
pop padding -> execute (all ranks concurrently, or rank 0) -> wait (when blocking) ->
collect -> unpad.

Where Podium deliberately differs from verl:

* Calls to the N workers are concurrent coroutines on the runtime's loop thread, and a
  payload several ranks receive (ONE_TO_ALL, the TP ranks of one dp rank under mesh
  dispatch) is encoded once and the same bytes are sent to each.
* ``blocking=False`` returns PendingRefs / a PendingDataProtoFuture (see
  :mod:`podium.controller.futures`); a future's padding is removed through its row range.
* ``Dispatch.RANK_ZERO`` is refused when the group is built, with a message that says to use
  ``Execute.RANK_ZERO`` (verl: a bare ``KeyError``).
* Under ``Execute.RANK_ZERO`` a dispatch that produced per-rank lists sends rank 0 its own
  slice (verl sends it the whole replicated list ``[x] * world_size``).
* ``master_addr``/``master_port`` arguments are refused with a clear error (verl ignores
  them silently); the scheduler reserves MASTER_PORT on rank 0's node.
* Errors: a method that raised gives RemoteError (rank + remote traceback); a worker that
  died gives WorkerDiedError with its rank, node, exit code or signal and stderr tail; every
  call has a deadline (the runtime's call timeout).
* ``spawn(prefix_set)`` maps role methods with the colocated class's own table, so the
  prefix ``actor`` does not also match ``actor_rollout_*`` methods.
* Lifetime is Ray's (:mod:`podium.controller.grouplife`): once the group and every view of it
  are garbage, its non-detached workers stop. Two live groups may share a ``name_prefix``
  when their classes differ (:meth:`GroupBuild._distinct_group_key`).

The class is assembled from :mod:`~podium.controller.groupbuild` (building),
:mod:`~podium.controller.groupcalls` (binding and running calls) and
:mod:`~podium.controller.groupverl` (verl's surface).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import string
from typing import Any

from podium.controller import grouplife
from podium.controller.groupbuild import GroupBuild
from podium.controller.groupcalls import GroupCalls, func_generator
from podium.controller.groupverl import GroupVerl
from podium.controller.groupworkers import WorkerHandle
from podium.controller.pool import ResourcePool
from podium.controller.runtime import get_runtime
from podium.errors import InvalidArgumentError
from podium.memcap import group_env
from podium.resources import check_user_env
from podium.worker.factory import ClassWithInitArgs

__all__ = ["WorkerGroup", "RayWorkerGroup", "WorkerHandle", "func_generator"]

log = logging.getLogger("podium.controller")

_group_ids = itertools.count(1)


class WorkerGroup(GroupVerl, GroupCalls, GroupBuild):
    """verl's ``RayWorkerGroup`` on Podium (alias :data:`RayWorkerGroup`).

    ``WorkerGroup(resource_pool, ray_cls_with_init)`` starts one worker per slot of the pool,
    builds ``ray_cls_with_init`` in each and binds its registered methods. ``worker_env``
    adds environment variables (a system variable -> ValueError naming it).
    ``gpu_memory_cap`` (default: the pool's, off unless set) caps each worker's GPU memory
    (see :class:`~podium.controller.pool.ResourcePool` and :mod:`podium.worker.host.gpucap`).
    ``resource_pool=None`` attaches to existing (detached) workers by ``worker_names``.
    """

    fused_worker_execute_fn_name = "_fuw_execute"

    def __init__(self, resource_pool: ResourcePool | None = None,
                 ray_cls_with_init: ClassWithInitArgs | None = None, bin_pack: bool = True,
                 name_prefix: str | None = None, detached: bool = False,
                 worker_names: list[str] | None = None, worker_handles: list[WorkerHandle] | None = None,
                 worker_env: dict[str, str] | None = None, gpu_memory_cap: Any = None,
                 **kwargs: Any) -> None:
        if kwargs.get("master_addr") is not None or kwargs.get("master_port") is not None:
            raise InvalidArgumentError(
                "master_addr/master_port cannot be chosen: the scheduler reserves MASTER_PORT on "
                "rank 0's node (verl ignores these arguments silently)")
        check_user_env(worker_env)
        worker_env = group_env(worker_env, resource_pool, gpu_memory_cap)
        self._rt = get_runtime()
        self._gid = next(_group_ids)
        self._is_init_with_detached_workers = resource_pool is None
        self.resource_pool = resource_pool
        self.ray_cls_with_init = ray_cls_with_init
        self.name_prefix = name_prefix if name_prefix is not None else "".join(
            random.choices(string.ascii_letters + string.digits, k=6))
        self.detached = detached
        self.use_gpu = kwargs.get("use_gpu", resource_pool.use_gpu if resource_pool is not None else True)
        self.device_name = kwargs.get("device_name", "cuda")
        self._workers: list[WorkerHandle] = []
        self._worker_names: list[str] = []
        self._world_size = 0
        self._dispatch_info: dict[str, list[int]] = {}
        self._collect_info: dict[str, list[bool]] = {}
        self._master_addr: str | None = None
        self._master_port: str | None = None
        self._owns_workers = False
        self._pg_ids: list[str] = []
        self._closed = False
        self.fused_worker_used = bool(getattr(ray_cls_with_init, "fused_worker_used", False))
        self.sub_cls_name = ""
        self.method_names: list[str] = []

        if resource_pool is None:
            self._init_with_detached_workers(worker_names, worker_handles)
        else:
            if ray_cls_with_init is None:
                raise InvalidArgumentError("a WorkerGroup on a resource pool needs ray_cls_with_init "
                                           "(the class each worker hosts)")
            self._init_with_resource_pool(resource_pool, ray_cls_with_init, bin_pack, detached, worker_env)
        if ray_cls_with_init is not None:
            self.method_names = self._bind_worker_method(ray_cls_with_init.cls, func_generator)
        # Ray's lifetime: the workers go once this group and all its views are garbage.
        self._life = grouplife.arm(self) if self._owns_workers and not detached else None

    def shutdown(self) -> None:
        """Stop this group's workers (orderly: no death is reported) and release its
        placement groups when no other group uses them. Views and attached groups only
        disconnect. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        owns = self._owns_workers and not self.detached
        life = getattr(self, "_life", None)  # None when __init__ failed before arming it
        if owns and life is not None:
            life.disarm()

        async def teardown():
            if owns or self._is_init_with_detached_workers:
                self._rt.deathwatch.forget([w.worker_id for w in self._workers])
            for w in self._workers:
                if w.client is not None and (owns or self._is_init_with_detached_workers):
                    with contextlib.suppress(Exception):
                        await w.client.close()
            if owns and self._workers:
                with contextlib.suppress(Exception):
                    await self._rt.scheduler.remove_workers([w.worker_id for w in self._workers])
            if self._pg_ids:
                await self._rt.release_pgs(self._gid, self._pg_ids)

        if self._rt._closed:
            return
        with contextlib.suppress(Exception):
            self._rt.run(teardown(), timeout=60, what="WorkerGroup shutdown")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name_prefix={self.name_prefix!r}, world_size={self.world_size})"


#: verl's name.
RayWorkerGroup = WorkerGroup
