"""Building a WorkerGroup: reserve the pool's placement groups, ask the scheduler for one
worker per bundle slot, wait for them (with progress lines), connect, construct the user
class in each; or attach to existing (detached) workers. A mixin of
:class:`podium.controller.group.WorkerGroup`."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from podium.controller.groupstate import GroupState
from podium.controller.groupworkers import WorkerHandle, _class_name
from podium.controller.pool import PACK, STRICT_PACK, ResourcePool
from podium.controller.progress import Progress
from podium.errors import InvalidArgumentError
from podium.worker.factory import ClassWithInitArgs, by_value

if TYPE_CHECKING:
    from podium.controller.group import WorkerGroup

__all__ = ["GroupBuild"]


class GroupBuild(GroupState):
    """How a WorkerGroup gets its workers (see the module docstring)."""

    def _init_with_resource_pool(self, pool: ResourcePool, cia: ClassWithInitArgs, bin_pack: bool,
                                 detached: bool, worker_env: dict[str, str] | None) -> None:
        from podium.v1 import common_pb2
        if cia is None:
            raise InvalidArgumentError("a WorkerGroup on a resource pool needs ray_cls_with_init")
        pool.get_placement_groups(strategy=STRICT_PACK if bin_pack else PACK, device_name=self.device_name)
        slots = pool.worker_slots()
        num_gpus = 1.0 / pool.max_colocate_count if pool.use_gpu else 0.0
        cls_name = _class_name(cia.cls)
        specs = [common_pb2.WorkerSpec(
            name=f"{self.name_prefix}{cls_name}_{pg_idx}:{bundle}", group=self.name_prefix,
            placement_group_id=pg.id, bundle_index=bundle, num_gpus=num_gpus, num_cpus=1.0,
            rank=rank, world_size=len(slots), env=dict(worker_env or {}), detached=detached)
            for rank, (pg, pg_idx, bundle) in enumerate(slots)]
        self._pg_ids = sorted({pg.id for pg, _, _ in slots})
        self._rt.acquire_pgs(self._gid, self._pg_ids)
        self._owns_workers = True
        self._rt.track_group(self)
        try:
            self._rt.run(self._start(specs, cia, detached), timeout=self._rt.placement_timeout + 60,
                         what=f"starting WorkerGroup {self.name_prefix!r}")
        except BaseException:
            self.shutdown()
            raise

    async def _start(self, specs: list, cia: ClassWithInitArgs, detached: bool) -> None:
        from podium.worker.client import prepare
        sched = self._rt.scheduler
        owner = "" if detached else self._rt.session_id
        from podium.v1 import common_pb2
        n = len(specs)
        ok = False
        waiting = None
        progress = Progress(f"WorkerGroup {self.name_prefix!r} ({n} workers)")
        try:
            progress.phase(f"creating {n} workers")
            await self._distinct_group_key(specs, _class_name(cia.cls))
            infos = await sched.create_workers(specs, owner=owner, master_rank=0)
            self._workers = [WorkerHandle(info, None) for info in infos]  # teardown knows them now
            progress.phase(f"0/{n} workers running")
            waiting = asyncio.ensure_future(
                sched.wait_workers([i.id for i in infos], timeout=self._rt.placement_timeout))
            while not waiting.done():  # counts for the progress lines, once they show
                await asyncio.wait({waiting}, timeout=1.0)
                if not waiting.done() and progress.late:
                    with contextlib.suppress(Exception):
                        now = await sched.get_workers(ids=[i.id for i in infos])
                        running = sum(1 for w in now if w.state == common_pb2.WORKER_RUNNING)
                        progress.phase(f"{running}/{n} workers running", count=True)
            infos = waiting.result()
            progress.phase(f"{n}/{n} workers running; connecting")
            if self._rt.log_to_driver is not None:
                await self._rt.log_to_driver.watch(sched, infos, _class_name(cia.cls))
            await self._connect(infos)
            with by_value(cia):
                payload = prepare(tuple(cia.construct_payload()))
            built = 0

            async def construct(w: WorkerHandle) -> None:
                nonlocal built
                await w.client.construct(payload, timeout=self._rt.call_timeout)
                built += 1
                progress.phase(f"constructed {built}/{n} {_class_name(cia.cls)}", count=True)

            progress.phase(f"constructing {_class_name(cia.cls)} in {n} workers")
            results = await asyncio.gather(*(construct(w) for w in self._workers), return_exceptions=True)
            for w, result in zip(self._workers, results):
                if isinstance(result, BaseException):
                    raise await self._convert(w, result, "the constructor")
            ok = True
        finally:
            if waiting is not None:
                waiting.cancel()  # a no-op once it finished; stops it when we were cancelled
            progress.done("ready" if ok else "failed")

    async def _distinct_group_key(self, specs: list, cls_name: str) -> None:
        """Ray accepts two live groups with one ``name_prefix`` (their actor names differ by
        class): when workers of ``name_prefix`` already run, this group's scheduler key
        (its WG_PREFIX, ranks and MASTER_PORT) becomes ``name_prefix + class name``."""
        from podium.v1 import common_pb2
        live = (common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING)
        existing = await self._rt.scheduler.get_workers(group=self.name_prefix)
        if any(w.state in live for w in existing):
            for spec in specs:
                spec.group = f"{self.name_prefix}{cls_name}"

    async def _connect(self, infos: list) -> None:
        from podium.worker.client import WorkerClient
        infos = sorted(infos, key=lambda i: i.spec.rank)
        handles = [WorkerHandle(info, WorkerClient(f"{info.node_address}:{info.port}", self._rt.token,
                                                   rank=info.spec.rank, worker_id=info.id,
                                                   tls=self._rt.tls))
                   for info in infos]
        self._workers = handles
        await asyncio.gather(*(h.client.start() for h in handles))
        watch = self._rt.deathwatch
        for h in handles:
            watch.watch(h.worker_id, h.client)
        self._worker_names = [h.name for h in handles]
        self._world_size = len(handles)
        if handles:
            env = handles[0].info.env
            self._master_addr = env.get("MASTER_ADDR") or handles[0].node_address
            self._master_port = env.get("MASTER_PORT") or None

    def _init_with_detached_workers(self, worker_names: list[str] | None,
                                    worker_handles: list[WorkerHandle] | None) -> None:
        if worker_handles is not None:
            self._workers = list(worker_handles)
            self._worker_names = [h.name for h in self._workers]
            self._world_size = len(self._workers)
            if self._workers:
                env = self._workers[0].info.env
                self._master_addr = env.get("MASTER_ADDR") or None
                self._master_port = env.get("MASTER_PORT") or None
            return

        async def attach():
            sched = self._rt.scheduler
            if worker_names:
                infos = await sched.get_workers(names=list(worker_names))
            else:
                infos = await sched.get_workers(group=self.name_prefix)
            if not infos:
                from podium.errors import NotFoundError
                raise NotFoundError(f"no workers named {worker_names or self.name_prefix!r}")
            await self._connect(list(infos))

        self._rt.run(attach(), timeout=60, what="attaching to workers")
        self._rt.track_group(self)

    @classmethod
    def from_detached(cls: Any, name_prefix: str | None = None, worker_names: list[str] | None = None,
                      worker_handles: list[WorkerHandle] | None = None,
                      ray_cls_with_init: ClassWithInitArgs | None = None, **kwargs: Any) -> "WorkerGroup":
        """A group over existing workers (by names, or every worker of ``name_prefix``)."""
        return cls(resource_pool=None, ray_cls_with_init=ray_cls_with_init, name_prefix=name_prefix,
                   worker_names=worker_names, worker_handles=worker_handles, **kwargs)
