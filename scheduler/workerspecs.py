"""Validation of CreateWorkers specs against the cluster model's tables (no change on error).

:meth:`WorkerTable.plan <podium.scheduler.workers.WorkerTable.plan>` and ``create`` call
:func:`check_specs` with the tables it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from podium import errors
from podium.runtimeenv import check_spec
from podium.resources import (check_user_env, cpu_units, format_cpus, format_custom, format_gpus, gpu_units,
                              parse_custom_resources)
from podium.scheduler.groups import GroupTable
from podium.scheduler.records import LIVE_WORKER_STATES
from podium.scheduler.sessions import SessionTable
from podium.v1 import common_pb2

__all__ = ["CheckedSpec", "check_specs"]

#: Per spec: (its group, the placement of its bundle, CPU units, GPU units).
CheckedSpec = tuple[common_pb2.PlacementGroup, common_pb2.BundlePlacement, int, int]


def _bundles_usage(members: Sequence[common_pb2.WorkerInfo]) -> dict[int, tuple[int, int]]:
    """CPU and GPU units the live ``members`` of one placement group use, per bundle index.

    One pass over the group's workers for all its bundles: a pass per bundle made a
    CreateWorkers of N workers on an N-bundle group cost O(N^2)."""
    usage: dict[int, tuple[int, int]] = {}
    for worker in members:
        if worker.state in LIVE_WORKER_STATES:
            spec = worker.spec
            cpu, gpu = usage.get(spec.bundle_index, (0, 0))
            usage[spec.bundle_index] = (cpu + _worker_cpu(spec), gpu + _worker_gpu(spec))
    return usage


def check_specs(specs: Sequence[common_pb2.WorkerSpec], owner: str, *,
                sessions: SessionTable, groups: GroupTable,
                workers: Mapping[str, common_pb2.WorkerInfo],
                workers_of_group: Callable[[str], Sequence[common_pb2.WorkerInfo]],
                ) -> list[CheckedSpec]:
    """Check every spec and every slot; per spec (group, bundle placement, cpu, gpu units).

    ``workers`` are every remembered worker (names and ranks must be free among the live
    ones); ``workers_of_group`` lists a placement group's workers (its bundles' usage).
    """
    if not specs:
        raise errors.InvalidArgumentError("CreateWorkers needs at least one worker spec")
    if owner:
        sessions.lookup(owner)
    names: set[str] = set()
    ranks: set[tuple[str, int]] = set()
    live_names = {w.spec.name: w for w in workers.values() if w.state in LIVE_WORKER_STATES}
    live_ranks = {(w.spec.group, w.spec.rank) for w in workers.values()
                  if w.state in LIVE_WORKER_STATES}
    wanted: dict[tuple[str, int], list[int]] = {}
    placements: dict[str, dict[int, common_pb2.BundlePlacement]] = {}
    customs: list[tuple[tuple[str, int], ...]] = []
    out = []
    for i, spec in enumerate(specs):
        label = f"worker spec {i} ({spec.name!r})"
        if not spec.name:
            raise errors.InvalidArgumentError(f"worker spec {i}: name is required")
        if spec.name in names:
            raise errors.InvalidArgumentError(f"{label}: name given twice in one request")
        holder = live_names.get(spec.name)
        if holder is not None:
            raise errors.AlreadyExistsError(f"worker name {spec.name!r} is already taken" + (
                f" by a worker still stopping on node {holder.node_id} (its agent has not confirmed "
                "the stop; the name is free once it does)"
                if holder.state == common_pb2.WORKER_STOPPING else ""))
        names.add(spec.name)
        if not spec.group:
            raise errors.InvalidArgumentError(f"{label}: group (WG_PREFIX) is required")
        if spec.world_size < 1:
            raise errors.InvalidArgumentError(f"{label}: world_size = {spec.world_size} must be >= 1")
        if not 0 <= spec.rank < spec.world_size:
            raise errors.InvalidArgumentError(
                f"{label}: rank = {spec.rank} must be in [0, world_size={spec.world_size})")
        key = (spec.group, spec.rank)
        if key in ranks or key in live_ranks:
            raise errors.InvalidArgumentError(
                f"{label}: rank {spec.rank} of group {spec.group!r} is already taken")
        ranks.add(key)
        try:
            check_user_env(dict(spec.env))
            check_spec(spec, label)
            gpu = 0 if spec.num_gpus == 0 else gpu_units(spec.num_gpus, name=f"{label}: num_gpus")
            cpu = cpu_units(spec.num_cpus, name=f"{label}: num_cpus")
            custom = parse_custom_resources(dict(spec.resources), what=f"{label}: resources")
        except errors.InvalidSpecError as exc:
            raise errors.InvalidSpecError(exc.message if label in exc.message
                                          else f"{label}: {exc.message}") from None
        if not spec.placement_group_id:
            raise errors.InvalidArgumentError(f"{label}: placement_group_id is required")
        group = groups.get(spec.placement_group_id)
        if group is None:
            raise errors.NotFoundError(
                f"{label}: unknown placement group id {spec.placement_group_id!r}")
        if group.state != common_pb2.PG_CREATED:
            state = common_pb2.PlacementGroupState.Name(group.state)
            raise errors.FailedPreconditionError(
                f"{label}: placement group {group.name!r} is {state}, not PG_CREATED"
                + (f" ({group.reason})" if group.reason else ""))
        if not 0 <= spec.bundle_index < len(group.bundles):
            raise errors.InvalidArgumentError(
                f"{label}: bundle_index = {spec.bundle_index} out of range "
                f"(group {group.name!r} has {len(group.bundles)} bundles)")
        bundle = groups.bundles(group.id)[spec.bundle_index]
        if gpu and not bundle.gpu_units:
            raise errors.InvalidSpecError(
                f"{label}: num_gpus = {spec.num_gpus!r} but bundle {spec.bundle_index} of "
                f"{group.name!r} has no GPU")
        missing = sorted(set(n for n, _ in custom) - set(n for n, _ in bundle.custom))
        if missing:
            raise errors.InvalidSpecError(
                f"{label}: asks for resources {missing} but bundle {spec.bundle_index} of "
                f"{group.name!r} holds none ({bundle.describe()})")
        customs.append(custom)
        by_index = placements.get(group.id)
        if by_index is None:  # once per group, not a scan of its placements per spec
            by_index = placements[group.id] = {p.bundle_index: p for p in group.placements}
        placed = by_index[spec.bundle_index]
        wanted.setdefault((group.id, spec.bundle_index), []).append(i)
        out.append((group, placed, cpu, gpu))
    usage: dict[str, dict[int, tuple[int, int]]] = {}
    for (group_id, index), members in wanted.items():
        bundle = groups.bundles(group_id)[index]
        if group_id not in usage:
            usage[group_id] = _bundles_usage(workers_of_group(group_id))
        used_cpu, used_gpu = usage[group_id].get(index, (0, 0))
        need_cpu = sum(out[i][2] for i in members)
        need_gpu = sum(out[i][3] for i in members)
        if used_cpu + need_cpu > bundle.cpu_units or used_gpu + need_gpu > bundle.gpu_units:
            name = groups[group_id].name
            raise errors.SlotFullError(
                f"bundle {index} of placement group {name!r} is full: it holds "
                f"{bundle.describe()}, workers already use CPU {format_cpus(used_cpu)} / "
                f"GPU {format_gpus(used_gpu)}, and {len(members)} more ask for "
                f"CPU {format_cpus(need_cpu)} / GPU {format_gpus(need_gpu)}")
        if bundle.custom:
            _check_custom(bundle, [customs[i] for i in members], workers_of_group(group_id), index,
                          groups[group_id].name)
    return out


def _check_custom(bundle, asked: list[tuple[tuple[str, int], ...]],
                  members: Sequence[common_pb2.WorkerInfo], index: int, name: str) -> None:
    """SlotFullError when the live ``members`` in bundle ``index`` and the ``asked`` new
    workers together take more of a custom resource than the bundle holds."""
    used: dict[str, int] = {}
    for worker in members:
        if worker.state in LIVE_WORKER_STATES and worker.spec.bundle_index == index and worker.spec.resources:
            for res, units in parse_custom_resources(dict(worker.spec.resources)):
                used[res] = used.get(res, 0) + units
    need: dict[str, int] = {}
    for custom in asked:
        for res, units in custom:
            need[res] = need.get(res, 0) + units
    for res, capacity in bundle.custom:
        if used.get(res, 0) + need.get(res, 0) > capacity:
            raise errors.SlotFullError(
                f"bundle {index} of placement group {name!r} is full: it holds {format_custom(capacity)} "
                f"{res}, workers already use {format_custom(used.get(res, 0))}, and new ones ask for "
                f"{format_custom(need.get(res, 0))}")


def _worker_cpu(spec: common_pb2.WorkerSpec) -> int:
    return cpu_units(spec.num_cpus) if spec.num_cpus else 0


def _worker_gpu(spec: common_pb2.WorkerSpec) -> int:
    return gpu_units(spec.num_gpus) if spec.num_gpus else 0
