"""Building a WorkerGroup's workers: the specs of a pool's slots, asking the scheduler for
one worker per slot and waiting for them (with progress lines), connecting, constructing the
user class in each; or attaching to existing (detached) workers.

Each step is a function over what it needs, passed explicitly: the runtime, the group's
:class:`~podium.controller.group.members.GroupMembers` (which they fill) and, to explain a
failed constructor, its :class:`~podium.controller.group.calls.GroupCaller`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from podium.controller.group.calls import GroupCaller
from podium.controller.group.handle import WorkerHandle, class_name
from podium.controller.group.members import GroupMembers
from podium.controller.pool import PACK, STRICT_PACK, ResourcePool
from podium.controller.session.progress import Progress
from podium.errors import InvalidArgumentError, NotFoundError
from podium.runtimeenv import spec_kwargs
from podium.worker.factory import ClassWithInitArgs, by_value


if TYPE_CHECKING:
    from podium.controller.session.contract import Session

__all__ = ["attach", "connect", "distinct_group_key", "pool_specs", "start_workers"]


def pool_specs(pool: ResourcePool, cia: ClassWithInitArgs, name_prefix: str, *, bin_pack: bool,
               detached: bool, worker_env: dict[str, str] | None,
               device_name: str) -> tuple[list, list[str]]:
    """Reserve ``pool``'s placement groups; the WorkerSpec of each of its slots (rank order)
    and the ids of the placement groups they use."""
    from podium.v1 import common_pb2
    if cia is None:
        raise InvalidArgumentError("a WorkerGroup on a resource pool needs ray_cls_with_init")
    pool.get_placement_groups(strategy=STRICT_PACK if bin_pack else PACK, device_name=device_name)
    slots = pool.worker_slots()
    num_gpus = 1.0 / pool.max_colocate_count if pool.use_gpu else 0.0
    cls_name = class_name(cia.cls)
    specs = [common_pb2.WorkerSpec(
        name=f"{name_prefix}{cls_name}_{pg_idx}:{bundle}", group=name_prefix,
        placement_group_id=pg.id, bundle_index=bundle, num_gpus=num_gpus, num_cpus=1.0,
        rank=rank, world_size=len(slots), env=dict(worker_env or {}), detached=detached,
        **spec_kwargs())  # the runtime_env this process inherited (ray.init's, as in Ray)
        for rank, (pg, pg_idx, bundle) in enumerate(slots)]
    return specs, sorted({pg.id for pg, _, _ in slots})


async def start_workers(rt: Session, members: GroupMembers, calls: GroupCaller, specs: list,
                        cia: ClassWithInitArgs, detached: bool, name_prefix: str) -> None:
    """Create the workers of ``specs``, wait until they run, connect (filling ``members``)
    and construct ``cia`` in each."""
    from podium.v1 import common_pb2
    from podium.worker.caller.client import prepare
    sched = rt.scheduler
    owner = "" if detached else rt.session_id
    n = len(specs)
    cls_name = class_name(cia.cls)
    ok = False
    waiting = None
    progress = Progress(f"WorkerGroup {name_prefix!r} ({n} workers)")
    try:
        progress.phase(f"creating {n} workers")
        await distinct_group_key(rt, specs, name_prefix, cls_name)
        infos = await sched.create_workers(specs, owner=owner, master_rank=0)
        members.reserve([WorkerHandle(info, None) for info in infos])  # teardown knows them now
        progress.phase(f"0/{n} workers running")
        waiting = asyncio.ensure_future(sched.wait_workers([i.id for i in infos], timeout=rt.placement_timeout))
        while not waiting.done():  # counts for the progress lines, once they show
            await asyncio.wait({waiting}, timeout=1.0)
            if not waiting.done() and progress.late:
                with contextlib.suppress(Exception):
                    now = await sched.get_workers(ids=[i.id for i in infos])
                    running = sum(1 for w in now if w.state == common_pb2.WORKER_RUNNING)
                    progress.phase(f"{running}/{n} workers running", count=True)
        infos = waiting.result()
        progress.phase(f"{n}/{n} workers running; connecting")
        if rt.log_to_driver is not None:
            await rt.log_to_driver.watch(sched, infos, cls_name)
        await connect(rt, members, infos, liveness=False)
        with by_value(cia):
            payload = prepare(tuple(cia.construct_payload()))
        built = 0

        async def construct(w: WorkerHandle) -> None:
            nonlocal built
            await w.client.construct(payload, timeout=rt.call_timeout)
            built += 1
            progress.phase(f"constructed {built}/{n} {cls_name}", count=True)

        progress.phase(f"constructing {cls_name} in {n} workers")
        workers = members.workers
        results = await asyncio.gather(*(construct(w) for w in workers), return_exceptions=True)
        for w, result in zip(workers, results):
            if isinstance(result, BaseException):
                raise await calls.convert(w, result, "the constructor")
        # Pings only from now on: decoding the constructor's payload imports the class's
        # module on the worker's loop thread, which answers no ping meanwhile.
        for w in workers:
            rt.deathwatch.liveness.watch(w.worker_id, w.client)
        ok = True
    finally:
        if waiting is not None:
            waiting.cancel()  # a no-op once it finished; stops it when we were cancelled
        progress.done("ready" if ok else "failed")


async def distinct_group_key(rt: Session, specs: list, name_prefix: str, cls_name: str) -> None:
    """Ray accepts two live groups with one ``name_prefix`` (their actor names differ by
    class): when workers of ``name_prefix`` already run, this group's scheduler key
    (its WG_PREFIX, ranks and MASTER_PORT) becomes ``name_prefix + class name``."""
    from podium.v1 import common_pb2
    live = (common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING)
    existing = await rt.scheduler.get_workers(group=name_prefix)
    if any(w.state in live for w in existing):
        for spec in specs:
            spec.group = f"{name_prefix}{cls_name}"


async def connect(rt: Session, members: GroupMembers, infos: list, liveness: bool = True) -> None:
    """Connect to the workers of ``infos`` (rank order), watch them for death, and record
    them in ``members``."""
    from podium.worker.caller.client import WorkerClient
    infos = sorted(infos, key=lambda i: i.spec.rank)
    handles = [WorkerHandle(info, WorkerClient(f"{info.node_address}:{info.port}", rt.token,
                                               rank=info.spec.rank, worker_id=info.id, tls=rt.tls))
               for info in infos]
    members.reserve(handles)
    await asyncio.gather(*(h.client.start() for h in handles))
    watch = rt.deathwatch
    for h in handles:
        watch.watch(h.worker_id, h.client, liveness=liveness)
    members.connected(handles)


async def attach(rt: Session, members: GroupMembers, worker_names: list[str] | None, name_prefix: str) -> None:
    """Connect to existing workers: those named ``worker_names``, else every worker of the
    group ``name_prefix`` (NotFoundError when there is none)."""
    sched = rt.scheduler
    if worker_names:
        infos = await sched.get_workers(names=list(worker_names))
    else:
        infos = await sched.get_workers(group=name_prefix)
    if not infos:
        raise NotFoundError(f"no workers named {worker_names or name_prefix!r}")
    await connect(rt, members, list(infos))
