"""``place``: decide where a placement group goes; ``apply``/``release``: take or give
back its resources in a snapshot. Pure functions of their arguments.
"""

from __future__ import annotations

from podium.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from podium.resources import GPU_UNITS, format_cpus, format_custom, format_gpus
from podium.scheduler.core.index import index_of
from podium.scheduler.core.views import (BundleAssignment, GpuView, Infeasible, NodeView,
                                         Placement, PlacementRequest, Snapshot, Unavailable)
from podium.scheduler.core.reasons import explain
from podium.scheduler.core.strategies import attempt

__all__ = ["place", "apply", "release"]


def place(request: PlacementRequest, snapshot: Snapshot) -> Placement | Infeasible | Unavailable:
    """Place every bundle of ``request`` on the free capacity of ``snapshot``, or none.

    Returns a :class:`Placement` (one assignment per bundle, in bundle order), an
    :class:`Infeasible` when even the idle cluster could not hold it (the caller
    should fail at once), or an :class:`Unavailable` when it would fit the idle
    cluster but not what is free now (the caller should wait). Deterministic: the
    same request on an equal snapshot gives the same answer, whatever the node order.
    """
    if not snapshot.nodes:
        return Infeasible("no nodes registered", {})
    bundles = request.bundles
    pinned = {b.node for b in bundles if b.node}
    if pinned:  # bundles pinned to a node (``node:<id or address>``): place among that node only
        if len(pinned) > 1 or not all(b.node for b in bundles):
            return Infeasible("the bundles of one placement group may pin one node, all of them or none", {})
        node = next(iter(pinned))
        matching = tuple(n for n in snapshot.nodes if node in (n.node_id, n.address))
        if not matching:
            return Infeasible(f"no alive node has id or address {node!r}", {})
        snapshot = Snapshot(matching)
    ix = index_of(snapshot)
    answer = attempt(ix, bundles, request.strategy)
    if answer is not None:
        views = ix.views
        return Placement(tuple(BundleAssignment(i, views[rank].node_id, gpus)
                               for i, (rank, gpus) in enumerate(answer)))
    idle = ix.idle_index()
    if attempt(idle, bundles, request.strategy) is None:
        return Infeasible(*explain(idle, bundles, request.strategy, free=False))
    return Unavailable(*explain(ix, bundles, request.strategy, free=True))


def _check_shape(placement: Placement, request: PlacementRequest) -> None:
    if len(placement.assignments) != len(request.bundles):
        raise InvalidArgumentError(
            f"placement has {len(placement.assignments)} assignments for "
            f"{len(request.bundles)} bundles")
    for i, a in enumerate(placement.assignments):
        if a.bundle_index != i:
            raise InvalidArgumentError(
                f"assignment {i} is for bundle {a.bundle_index}; assignments must be in bundle order")


def _changed(snapshot: Snapshot, placement: Placement, request: PlacementRequest,
             sign: int) -> Snapshot:
    # sign -1 takes the placement's resources, +1 gives them back.
    _check_shape(placement, request)
    ix = index_of(snapshot)
    verb = "apply" if sign < 0 else "release"
    cpu: dict[int, int] = {}
    gpus: dict[int, dict[int, int]] = {}  # rank -> GPU index -> free units
    custom: dict[int, dict[str, int]] = {}  # rank -> custom resource -> free units
    for a, bundle in zip(placement.assignments, request.bundles):
        rank = ix.ranks.get(a.node_id)
        if rank is None:
            if sign > 0:
                continue  # the node is gone (dead): nothing there to give back
            raise NotFoundError(f"cannot {verb} bundle {a.bundle_index}: node {a.node_id!r} "
                                "is not in the snapshot")
        view = ix.views[rank]
        where = f"bundle {a.bundle_index} on node {a.node_id}"
        free_cpu = cpu.get(rank, view.free_cpu_units) + sign * bundle.cpu_units
        if free_cpu < 0:
            raise ResourceExhaustedError(
                f"cannot {verb} {where}: it needs {format_cpus(bundle.cpu_units)} CPUs, "
                f"{format_cpus(cpu.get(rank, view.free_cpu_units))} free")
        if free_cpu > view.total_cpu_units:
            raise InvalidArgumentError(
                f"cannot {verb} {where}: the node would have more than its "
                f"{format_cpus(view.total_cpu_units)} CPUs free (released twice?)")
        cpu[rank] = free_cpu
        if bundle.custom:
            _change_custom(custom.setdefault(rank, dict(view.custom_free)), dict(view.custom_total),
                           bundle.custom, sign, verb, where)
        if bundle.gpu_units == 0:
            if a.gpu_indices:
                raise InvalidArgumentError(f"{where} is CPU-only but lists GPUs {a.gpu_indices}")
            continue
        if len(a.gpu_indices) != bundle.gpus_needed or len(set(a.gpu_indices)) != len(a.gpu_indices):
            raise InvalidArgumentError(
                f"{where} needs {bundle.gpus_needed} distinct GPUs, got {a.gpu_indices}")
        node_gpus = {g.index: g for g in view.gpus}
        state = gpus.setdefault(rank, {})
        for index in a.gpu_indices:
            g = node_gpus.get(index)
            if g is None:
                raise NotFoundError(f"{where}: node {a.node_id} has no GPU {index}")
            units = bundle.gpu_units if bundle.gpu_units < GPU_UNITS else g.total_units
            before = state.get(index, g.free_units)
            after = before + sign * units
            if after < 0:
                raise ResourceExhaustedError(
                    f"cannot {verb} {where}: GPU {index} has {format_gpus(before)} free, "
                    f"it needs {format_gpus(units)}")
            if after > g.total_units:
                raise InvalidArgumentError(
                    f"cannot {verb} {where}: GPU {index} would have more than all of it "
                    "free (released twice?)")
            state[index] = after
    changes: dict[int, NodeView] = {}
    for rank, free_cpu in cpu.items():
        view = ix.views[rank]
        node_state = gpus.get(rank)
        new_gpus = view.gpus if not node_state else tuple(
            g if g.index not in node_state else
            GpuView(g.index, g.uuid, node_state[g.index], g.total_units, g.memory_total_bytes)
            for g in view.gpus)
        node_custom = custom.get(rank)
        changes[rank] = NodeView(view.node_id, view.address, view.total_cpu_units,
                                 free_cpu, new_gpus, view.custom_total,
                                 view.custom_free if node_custom is None else tuple(sorted(node_custom.items())))
    if not changes:
        return snapshot
    nodes = list(snapshot.nodes)
    for rank, view in changes.items():
        nodes[ix.positions[rank]] = view
    out = Snapshot(tuple(nodes))
    object.__setattr__(out, "_index", ix.replaced(changes))
    return out


def _change_custom(free: dict[str, int], total: dict[str, int], asked: tuple[tuple[str, int], ...],
                   sign: int, verb: str, where: str) -> None:
    """Take (sign -1) or give back (+1) a bundle's custom resources in ``free`` (in place)."""
    for name, units in asked:
        before = free.get(name)
        if before is None:
            raise NotFoundError(f"cannot {verb} {where}: the node has no resource {name!r}")
        after = before + sign * units
        if after < 0:
            raise ResourceExhaustedError(f"cannot {verb} {where}: it needs {format_custom(units)} {name}, "
                                         f"{format_custom(before)} free")
        if after > total[name]:
            raise InvalidArgumentError(f"cannot {verb} {where}: the node would have more than its "
                                       f"{format_custom(total[name])} {name} free (released twice?)")
        free[name] = after


def apply(snapshot: Snapshot, placement: Placement, request: PlacementRequest) -> Snapshot:
    """The snapshot with the placement's resources taken (the input is unchanged).

    Raises ResourceExhaustedError if they are not free (a stale placement),
    NotFoundError for an unknown node or GPU, InvalidArgumentError when the
    placement does not match the request.
    """
    return _changed(snapshot, placement, request, -1)


def release(snapshot: Snapshot, placement: Placement, request: PlacementRequest) -> Snapshot:
    """The inverse of :func:`apply`: the snapshot with the placement's resources free.

    Bundles on nodes absent from the snapshot (dead nodes) are skipped. Giving back
    more than a node has raises InvalidArgumentError (a double release).
    """
    return _changed(snapshot, placement, request, +1)
