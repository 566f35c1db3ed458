"""Where an actor's worker runs and how it is built and removed: its reservation (a
one-bundle placement group of its own, or a bundle it is given), its worker, its
constructor, its removal; and the groups this process attached to actors, by worker id.
Shared by starting an actor (:mod:`.actors`) and restarting one (:mod:`.restarts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from typing import TYPE_CHECKING, Any

from podium.controller.remote.actoroptions import runtime_spec_fields
from podium.errors import InfeasibleError, InvalidArgumentError, SlotFullError

if TYPE_CHECKING:
    from podium.controller.remote.actoroptions import Options
    from podium.controller.session.contract import Session

__all__ = ["ZERO_RESOURCE_CPU", "SLOT_RECLAIMERS", "attached", "reserve", "create_worker", "construct", "remove",
           "described_once_read"]

#: The CPU an actor or task asking for no resource at all (``num_cpus=0``, no GPU, no custom
#: resource) reserves: the smallest share Podium counts (1/1000 CPU, podium.resources.CPU_UNITS).
ZERO_RESOURCE_CPU = 0.001

#: The one-worker group of each actor this process has attached to, by worker id: handles
#: to one actor share it (and its connection), whether made here, looked up or borrowed.
attached: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()

#: Coroutines ``(rt, pg_id, bundle) -> count`` that stop idle workers holding room in a full
#: bundle which Ray would count as free: the task pool's idle workers (a Ray task frees its
#: resources when it ends; Podium keeps the worker for the next task until the room is asked
#: for). :mod:`.tasks` registers its own.
SLOT_RECLAIMERS: list = []


async def _reclaim(rt: "Session", pg_id: str, bundle: int) -> int:
    count = 0
    for reclaim in list(SLOT_RECLAIMERS):
        count += await reclaim(rt, pg_id, bundle)
    return count


async def reserve(rt: Session, opts: Options, wname: str) -> tuple[str, int, str]:
    """(placement group id, bundle index, id of a group made for this actor or "")."""
    if opts.placement_group is not None:
        if opts.node is not None:
            raise InvalidArgumentError("give a placement group or a node, not both")
        pg = opts.placement_group
        pg_id = getattr(pg, "id", pg)
        if not isinstance(pg_id, str):
            raise InvalidArgumentError(f"placement_group must be a placement group or its id, got {pg!r}")
        return pg_id, opts.bundle_index, ""
    bundle = {"CPU": opts.num_cpus, **opts.resources}
    if opts.num_gpus:
        bundle["GPU"] = opts.num_gpus
    if not opts.num_cpus and not opts.num_gpus and not any(opts.resources.values()):
        # Ray places a 0-resource actor or task without reserving anything; a Podium worker
        # lives in a bundle, and a bundle must hold something: the least CPU share there is.
        bundle["CPU"] = ZERO_RESOURCE_CPU
    if opts.node is not None:  # pinned: the scheduler places it on that node or says why not
        bundle[f"node:{opts.node}"] = 1.0
    owner = "" if opts.detached else rt.session_id
    try:
        pg = await rt.scheduler.create_placement_group(wname, [bundle], "PACK", detached=opts.detached,
                                                       owner=owner)
    except InfeasibleError:
        if not opts.node_soft:
            raise
        del bundle[f"node:{opts.node}"]  # soft affinity: anywhere it fits
        pg = await rt.scheduler.create_placement_group(wname, [bundle], "PACK", detached=opts.detached,
                                                       owner=owner)
    try:
        await rt.scheduler.wait_placement_group(pg.id, timeout=rt.placement_timeout)
    except BaseException:
        with contextlib.suppress(Exception):
            await rt.scheduler.remove_placement_group(pg.id)
        raise
    return pg.id, 0, pg.id


async def create_worker(rt: Session, opts: Options, wname: str, pg_id: str, bundle: int,
                         restarts: int = 0) -> Any:
    from podium.v1 import common_pb2

    owner = "" if opts.detached else rt.session_id
    if bundle >= 0:
        candidates = [bundle]
    else:  # -1: the first bundle with room, as Ray
        info = await rt.scheduler.get_placement_group(pg_id)
        candidates = list(range(len(info.bundles)))
    for i, index in enumerate(candidates):
        spec = common_pb2.WorkerSpec(name=wname, group=wname, placement_group_id=pg_id, bundle_index=index,
                                     num_cpus=opts.num_cpus, num_gpus=opts.num_gpus, rank=0, world_size=1,
                                     env=opts.env, detached=opts.detached, resources=opts.resources, restarts=restarts,
                                     max_restarts=opts.max_restarts, max_task_retries=opts.max_task_retries,
                                     **runtime_spec_fields(opts))
        infos = None
        for attempt in (0, 1):  # once more after idle task workers gave the bundle's room back
            try:
                infos = await rt.scheduler.create_workers([spec], owner=owner, master_rank=0)
                break
            except SlotFullError:
                if attempt == 0 and pg_id and await _reclaim(rt, pg_id, index):
                    continue
                if i == len(candidates) - 1:
                    raise
                break
        if infos is None:
            continue
        return (await rt.scheduler.wait_workers([infos[0].id], timeout=rt.placement_timeout))[0]
    raise InvalidArgumentError(f"placement group {pg_id} has no bundles")


async def construct(group: Any, payload: Any) -> None:
    worker = group.workers[0]
    try:
        await worker.client.construct(payload, timeout=group._rt.call_timeout)
    except BaseException as exc:
        raise await group._calls.convert(worker, exc, "the constructor") from None


async def remove(rt: Session, group: Any, pg_id: str = "") -> None:
    """Remove the actor's worker (and ``pg_id``), on the runtime's loop."""
    worker = group.workers[0]
    with contextlib.suppress(Exception):
        await rt.scheduler.remove_workers([worker.worker_id])
    client = worker.client
    for _ in range(100):  # up to 5 s for the stream to see the process go
        if client.broken is not None or not client.pending:
            break
        await asyncio.sleep(0.05)
    rt.deathwatch.forget([worker.worker_id])
    with contextlib.suppress(Exception):
        await client.close()
    if pg_id:
        with contextlib.suppress(Exception):
            await rt.scheduler.remove_placement_group(pg_id)


async def described_once_read(client: Any) -> Any:
    """An actor's Describe once its worker has read its class (so it tells what the methods
    return: ``method_returns``), waiting at most 60 s for a CONSTRUCT still on its way."""
    deadline = time.monotonic() + 60
    while True:
        described = await client.describe()
        if described.class_name or time.monotonic() > deadline:
            return described
        await asyncio.sleep(0.05)
