"""Standby workers and rank replacement for a WorkerGroup (issue 51).

:class:`RankReplacer` holds a group's warm standbys (constructed workers of the group's class
on a placement group of their own, outside the rank table, placed with the group's
strategy) and replaces rank ``i``:

1. fence: the old worker is removed through the scheduler (its agent SIGKILLs it, a stopped
   process too, and reaps it) before anything takes its place, and its client is closed,
   so its process is never live twice and nothing reaches it again;
2. handover: a standby (or, with none left, a fresh worker on the old one's bundle) gets
   rank ``i``'s place in the rank table, so dispatch and collect reach it, and the
   scheduler records it in the group with rank ``i`` (AssignWorkers);
3. rendezvous: version + 1, a new MASTER_PORT bound by rank 0 outside the ephemeral range
   and a new Podium store served by rank 0 on its node address (``Rendezvous.store()``),
   and every rank, old and new, adopts it (:mod:`podium.worker.rendezvous`: env, rank,
   then its ``@on_rendezvous`` hooks, all ranks at once).

Each step's seconds are kept in :attr:`RankReplacer.last_timings` (the bench reads them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from podium.controller.group.build import connect
from podium.controller.group.handle import WorkerHandle, class_name
from podium.controller.group.members import GroupMembers
from podium.errors import InvalidArgumentError, PodiumError

if TYPE_CHECKING:
    from podium.controller.group.calls import GroupCaller
    from podium.controller.session.contract import Session
    from podium.worker.factory import ClassWithInitArgs

__all__ = ["MAX_STANDBY", "RankReplacer", "ON_RANK_DEATH"]

log = logging.getLogger("podium.controller")

#: The most standbys one group keeps.
MAX_STANDBY = 64
#: What ``on_rank_death`` accepts: fail the call (today's behaviour) or replace the rank.
ON_RANK_DEATH = ("raise", "replace")


class RankReplacer:
    """A group's standbys, its rendezvous version, and :meth:`replace` (module docstring)."""

    def __init__(self, rt: Session, members: GroupMembers, calls: GroupCaller, cia: ClassWithInitArgs,
                 name_prefix: str, owner: str) -> None:
        self._rt = rt
        self._members = members
        self._calls = calls
        self._cia = cia
        self._prefix = name_prefix
        self._owner = owner
        #: Warm standbys, constructed, not in the rank table.
        self.standbys: list[WorkerHandle] = []
        #: The rendezvous version (0 until the first replacement).
        self.version = 0
        #: Replacements made.
        self.replaced = 0
        #: Seconds of each step of the last replacement: fence, handover, rendezvous.
        self.last_timings: dict[str, float] = {}
        self._fresh = 0

    # ---- standbys -------------------------------------------------------------------------

    async def start_standbys(self, pg: Any, count: int, num_gpus: float, env: dict[str, str]) -> None:
        """Create ``count`` standbys on the bundles of ``pg`` and construct the group's class
        in each (their env says rank ``j`` of ``count`` until one adopts a rank)."""
        from podium.v1 import common_pb2
        cls_name = class_name(self._cia.cls)
        specs = [common_pb2.WorkerSpec(
            name=f"{self._prefix}{cls_name}_standby:{j}", group=f"{self._prefix}.standby",
            placement_group_id=pg.id, bundle_index=j, num_gpus=num_gpus, num_cpus=1.0,
            rank=j, world_size=count, env=dict(env)) for j in range(count)]
        infos = await self._rt.scheduler.create_workers(specs, owner=self._owner, master_rank=0)
        self.standbys = await self._start(infos)

    async def _start(self, infos: list) -> list[WorkerHandle]:
        """Wait for created workers, connect and construct the group's class in each."""
        from podium.worker.caller.client import prepare
        from podium.worker.factory import by_value
        rt = self._rt
        infos = await rt.scheduler.wait_workers([i.id for i in infos], timeout=rt.placement_timeout)
        scratch = GroupMembers()
        await connect(rt, scratch, list(infos), liveness=False)
        with by_value(self._cia):
            payload = prepare(tuple(self._cia.construct_payload()))
        await asyncio.gather(*(w.client.construct(payload, timeout=rt.call_timeout) for w in scratch.workers))
        for w in scratch.workers:
            rt.deathwatch.liveness.watch(w.worker_id, w.client)
        return list(scratch.workers)

    def all_worker_ids(self) -> list[str]:
        """The standbys' worker ids (teardown removes them with the group)."""
        return [w.worker_id for w in self.standbys]

    async def close(self) -> None:
        """Disconnect and remove the standbys left."""
        standbys, self.standbys = self.standbys, []
        await self._remove(standbys)

    async def _remove(self, workers: list[WorkerHandle]) -> None:
        if not workers:
            return
        self._rt.deathwatch.forget([w.worker_id for w in workers])
        for w in workers:
            if w.client is not None:
                with contextlib.suppress(Exception):
                    await w.client.close()
        with contextlib.suppress(Exception):
            await self._rt.scheduler.remove_workers([w.worker_id for w in workers])

    # ---- replacement ----------------------------------------------------------------------

    async def replace(self, ranks: list[int], chosen: WorkerHandle | None = None) -> list[WorkerHandle]:
        """Replace ``ranks`` (fence, handover each; then one rendezvous): the new handles.
        ``chosen``, one of :attr:`standbys`, takes the (single) rank instead of the first one."""
        members = self._members
        for rank in ranks:
            if not 0 <= rank < members.world_size:
                raise InvalidArgumentError(f"replace_rank({rank}): the group has ranks 0..{members.world_size - 1}")
        if chosen is not None and (len(ranks) != 1 or chosen not in self.standbys):
            # Checked before the fence: a refused call leaves the group as it was.
            raise InvalidArgumentError(f"replace_worker({ranks}, {chosen!r}): the new worker must be one of the "
                                       f"group's standbys (wg.standby_workers; WorkerGroup(..., standby=k) makes "
                                       f"them), or None for the next standby or a fresh worker")
        t0 = time.perf_counter()
        # Fenced: killed and reaped before anyone takes their place.
        await self._remove([members.workers[rank] for rank in ranks])
        members.dead.difference_update(ranks)
        t1 = time.perf_counter()
        sources = []
        handles = []
        for rank in ranks:
            old = members.workers[rank]
            gone = [w for w in self.standbys if w.client is None or w.client.broken is not None]
            if gone:  # a standby that died meanwhile is no standby
                self.standbys = [w for w in self.standbys if w not in gone]
                await self._remove(gone)
            if chosen is not None:
                self.standbys.remove(chosen)
                new = chosen
                sources.append("standby")
            elif self.standbys:
                new = self.standbys.pop(0)
                sources.append("standby")
            else:
                new = await self._fresh_worker(old)
                sources.append("fresh worker")
            handle = WorkerHandle(_with_rank(new.info, self._prefix, rank, members.world_size), new.client)
            if handle.client is not None:  # its errors name its new rank
                handle.client.channel.rank = rank
            members.workers[rank] = handle
            members.names[rank] = handle.name
            handles.append(handle)
        # The scheduler's record follows: `podium status`, the dashboard and an attach by
        # name_prefix see the newcomer in the group, with its rank, not under ".standby".
        await self._rt.scheduler.assign_workers(
            [(h.worker_id, self._prefix, h.rank, members.world_size) for h in handles])
        t2 = time.perf_counter()
        await self.rendezvous()
        members.broken = None  # every rank took the new rendezvous
        t3 = time.perf_counter()
        self.replaced += len(ranks)
        self.last_timings = {"fence": t1 - t0, "handover": t2 - t1, "rendezvous": t3 - t2}
        log.warning("WorkerGroup %r: ranks %s replaced by %s (rendezvous version %d)", self._prefix, ranks,
                    ", ".join(f"{s} {h.name}" for s, h in zip(sources, handles)), self.version)
        return handles

    async def _fresh_worker(self, old: WorkerHandle) -> WorkerHandle:
        """A new worker of the group's class on the old one's (now free) bundle."""
        from podium.v1 import common_pb2
        self._fresh += 1
        spec = common_pb2.WorkerSpec()
        spec.CopyFrom(old.info.spec)
        spec.name = f"{old.info.spec.name}~{self._fresh}"
        spec.group = f"{self._prefix}.fresh{self._fresh}"
        spec.rank = 0
        spec.world_size = 1
        infos = await self._rt.scheduler.create_workers([spec], owner=self._owner, master_rank=0)
        return (await self._start(infos))[0]

    async def rendezvous(self) -> None:
        """A new rendezvous version: rank 0 binds a new MASTER_PORT, every rank adopts it."""
        from podium.worker import rendezvous as rdzv
        members = self._members
        self.version += 1
        first = members.workers[0]
        addr = first.node_address  # rank 0's node: it may be a new process on another node
        port, store_port, key = await first.client.call("__ray_call__", (rdzv.open_port, addr), {},
                                                        timeout=self._rt.call_timeout)
        members.master_addr, members.master_port = addr, str(port)
        name = f"{self._prefix}.v{self.version}"
        calls = [w.client.call("__ray_call__", (rdzv.adopt, rdzv.Rendezvous(
            self.version, w.rank, members.world_size, addr, port, name, store_port, key)), {},
            timeout=self._rt.call_timeout) for w in members.workers]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for w, result in zip(members.workers, results):
            if isinstance(result, BaseException):
                raise await self._calls.convert(w, result, f"rendezvous version {self.version}")


def spare_pool(rt: Session, pool: Any, count: int, bin_pack: bool, name_prefix: str,
               detached: bool) -> tuple[Any, str]:
    """The pool of ``count`` standby bundles like ``pool``'s and its strategy (the group's:
    STRICT_PACK, or PACK for ``bin_pack=False``), checked against the cluster's free
    capacity now: InfeasibleError with each node's reason when it does not fit."""
    from podium.controller.pool import PACK, STRICT_PACK, ResourcePool
    from podium.controller.session.capacity import snapshot_of
    from podium.errors import InfeasibleError
    from podium.resources import BundleSpec, Strategy
    from podium.scheduler.core import Placement, PlacementRequest, place
    spare = ResourcePool([count], use_gpu=pool.use_gpu, max_colocate_count=pool.max_colocate_count,
                         name_prefix=f"{name_prefix}standby_", detached=detached)
    strategy = STRICT_PACK if bin_pack else PACK
    request = PlacementRequest(bundles=(BundleSpec.from_resources(spare.bundle()),) * count,
                               strategy=Strategy.STRICT_PACK if bin_pack else Strategy.PACK)
    result = place(request, snapshot_of(rt.run(rt.cluster_state())))
    if not isinstance(result, Placement):
        raise InfeasibleError(f"standby={count}: {count} x {spare.bundle()} ({strategy}) do not fit beside the "
                              f"group's own bundles: {result.message}", node_reasons=dict(result.node_reasons))
    return spare, strategy


def _with_rank(info: Any, group: str, rank: int, world_size: int) -> Any:
    """A copy of a WorkerInfo that names ``rank`` of ``world_size`` in ``group`` (the handle's
    rank, as the scheduler records it after AssignWorkers)."""
    from podium.v1 import common_pb2
    out = common_pb2.WorkerInfo()
    out.CopyFrom(info)
    out.spec.group = group
    out.spec.rank = rank
    out.spec.world_size = world_size
    return out


def check_policy(standby: Any, on_rank_death: Any) -> None:
    """Refuse a bad ``standby`` count or ``on_rank_death`` policy with the reason."""
    if not isinstance(standby, int) or isinstance(standby, bool) or not 0 <= standby <= MAX_STANDBY:
        raise InvalidArgumentError(f"standby must be an int in 0..{MAX_STANDBY}, got {standby!r}")
    if on_rank_death not in ON_RANK_DEATH:
        raise InvalidArgumentError(f"on_rank_death must be one of {ON_RANK_DEATH}, got {on_rank_death!r}")


def not_replaceable(label: str) -> PodiumError:
    """The error of replace_rank on a group that does not own its workers."""
    return InvalidArgumentError(f"WorkerGroup {label!r} does not own its workers (a view or an attached "
                                "group): replace ranks on the group that started them")
