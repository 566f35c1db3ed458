"""Why a placement group does not fit: a message and one reason per node, with numbers.

Used twice with the same words: on the idle cluster (``free=False``: Infeasible, "4
GPUs, bundle group needs 8 on one node (STRICT_PACK)") and on the free capacity now
(``free=True``: Unavailable, "4 of 8 GPUs free, bundle group needs 6 on one node").
Only failures pay for this, so it may look at every node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from podium.resources import GPU_UNITS, BundleSpec, Strategy, format_cpus, format_custom, format_gpus
from podium.scheduler.core.fit import NodeFill, fill_order
from podium.scheduler.core.index import CapacityIndex
from podium.scheduler.core.strategies import Demand

__all__ = ["describe_bundles", "explain"]


def describe_bundles(bundles: Sequence[BundleSpec]) -> str:
    """``8 x {CPU: 1, GPU: 1}``, identical bundles counted, in first-seen order."""
    counts = Counter(bundles)
    return " + ".join(f"{n} x {b.describe()}" for b, n in counts.items())


def _cpus(fill: NodeFill, free: bool) -> str:
    total = format_cpus(fill.view.total_cpu_units)
    return f"{format_cpus(fill.cpu)} of {total} CPUs free" if free else f"{total} CPUs"


def _gpus(fill: NodeFill, free: bool) -> str:
    n = len(fill.free)
    if n == 0:
        return "no GPUs"
    return f"{format_gpus(fill.free_gpu_units)} of {n} GPUs free" if free else f"{n} GPUs"


def _idle(fill: NodeFill, free: bool) -> str:
    n = len(fill.free)
    if n == 0:
        return "no GPUs"
    return f"{fill.idle_gpus} of {n} GPUs idle" if free else f"{n} GPUs"


def _custom(fill: NodeFill, name: str, free: bool) -> str:
    total = dict(fill.view.custom_total).get(name)
    if total is None:
        return f"no {name}"
    return f"{format_custom(fill.custom[name])} of {format_custom(total)} {name} free" if free \
        else f"{format_custom(total)} {name}"


def _short_custom(fill: NodeFill, custom: tuple[tuple[str, int], ...]) -> tuple[str, int] | None:
    # The first custom resource this node has less of than ``custom`` asks.
    for name, need in custom:
        if fill.custom.get(name, 0) < need:
            return name, need
    return None


def why_not_bundle(fill: NodeFill, b: BundleSpec, free: bool) -> str | None:
    """Why this node cannot hold even bundle ``b`` alone, or None if it can."""
    if b.cpu_units > fill.cpu:
        return f"{_cpus(fill, free)}, a bundle needs {format_cpus(b.cpu_units)}"
    short = _short_custom(fill, b.custom)
    if short is not None:
        return f"{_custom(fill, short[0], free)}, a bundle needs {format_custom(short[1])}"
    if b.gpu_units >= GPU_UNITS:
        n = b.gpu_units // GPU_UNITS
        if fill.idle_gpus < n:
            return f"{_idle(fill, free)}, a bundle needs {n} whole GPU{'s' if n > 1 else ''}"
    elif b.gpu_units > 0 and fill.largest_free < b.gpu_units:
        if not fill.free:
            return f"no GPUs, a bundle needs {format_gpus(b.gpu_units)} GPU"
        return (f"no GPU has {format_gpus(b.gpu_units)} free (most free on one GPU: "
                f"{format_gpus(fill.largest_free)})")
    return None


def _why_not_group(fill: NodeFill, d: Demand, free: bool) -> str:
    # The first dimension the whole group (demand d) overflows on this node (STRICT_PACK).
    tag = "on one node (STRICT_PACK)"
    if d.gpu_units > fill.free_gpu_units:
        return f"{_gpus(fill, free)}, bundle group needs {format_gpus(d.gpu_units)} {tag}"
    if d.idle_gpus > fill.idle_gpus:
        return f"{_idle(fill, free)}, bundle group needs {d.idle_gpus} whole GPUs {tag}"
    if d.cpu > fill.cpu:
        return f"{_cpus(fill, free)}, bundle group needs {format_cpus(d.cpu)} {tag}"
    short = _short_custom(fill, d.custom)
    if short is not None:
        return f"{_custom(fill, short[0], free)}, bundle group needs {format_custom(short[1])} {tag}"
    return (f"{_gpus(fill, free)}: the group's fractional bundles cannot share them "
            f"without splitting a bundle across GPUs {tag}")


def _why_not_node(fill: NodeFill, bundles: Sequence[BundleSpec], distinct: list[BundleSpec],
                  order: list[int], demand: Demand, strategy: Strategy,
                  free: bool) -> tuple[str | None, bool]:
    # (reason, whether the node can hold at least one bundle); reason None marks a
    # STRICT_SPREAD node that can hold one, worded by the caller.
    single = [why_not_bundle(fill, b, free) for b in distinct]
    if all(single):
        return single[0], False
    if strategy is Strategy.STRICT_PACK:
        return _why_not_group(fill, demand, free), True
    if strategy is Strategy.STRICT_SPREAD:
        return None, True
    held = fill.count_fitting(bundles, order)
    return (f"holds {held} of the {len(bundles)} bundles "
            f"({_gpus(fill, free)}, {_cpus(fill, free)})"), True


def _totals(ix: CapacityIndex, free: bool) -> str:
    n = len(ix)
    nodes = f"{n} node{'s' if n != 1 else ''}"
    gpus, cpus = ix.total_gpus, format_cpus(ix.total_cpu)
    if not free:
        return f"{nodes} with {gpus} GPUs and {cpus} CPUs in total"
    return (f"{format_gpus(ix.free_gpu_units)} of {gpus} GPUs and {format_cpus(ix.free_cpu)} of "
            f"{cpus} CPUs free on {nodes}")


def _custom_totals(ix: CapacityIndex, demand: Demand, free: bool) -> str:
    # The cluster's amounts of the custom resources the group asks for ("" when it asks none).
    parts = []
    for name, _ in demand.custom:
        total = sum(dict(v.custom_total).get(name, 0) for v in ix.views)
        if free:
            have = sum(dict(v.custom_free).get(name, 0) for v in ix.views)
            parts.append(f"{format_custom(have)} of {format_custom(total)} {name} free")
        else:
            parts.append(f"{format_custom(total)} {name} in total")
    return "".join(f"; {p}" for p in parts)


def explain(ix: CapacityIndex, bundles: Sequence[BundleSpec], strategy: Strategy,
            free: bool) -> tuple[str, dict[str, str]]:
    """The message and per-node reasons for a group that did not fit ``ix``.

    ``free`` selects the wording: capacity free now (Unavailable) or the capacity
    of the idle cluster (Infeasible).
    """
    order = fill_order(bundles)
    distinct = list(dict.fromkeys(bundles[i] for i in order))
    m = len(bundles)
    demand = Demand.of(bundles)
    reasons: dict[str, str] = {}
    can_hold_one = 0
    spread_nodes: list[str] = []
    # Many nodes are in the same state (idle, full, half used): word each state once.
    by_state: dict[str, tuple[str | None, bool]] = {}
    for view in ix.views:
        known = by_state.get(view.capacity_key)
        if known is None:
            known = by_state[view.capacity_key] = _why_not_node(
                NodeFill(view), bundles, distinct, order, demand, strategy, free)
        reason, holds_one = known
        can_hold_one += holds_one
        if reason is None:
            spread_nodes.append(view.node_id)  # worded below, once the count is known
        else:
            reasons[view.node_id] = reason
    for node_id in spread_nodes:
        reasons[node_id] = (f"can hold a bundle, but STRICT_SPREAD allows one bundle per node: "
                            f"{m} bundles need {m} nodes, {can_hold_one} can hold one")
    group = f"{strategy.name} group of {describe_bundles(bundles)}"
    if strategy is Strategy.STRICT_PACK:
        why = "no node can hold all of it"
    elif strategy is Strategy.STRICT_SPREAD:
        why = f"it needs {m} distinct nodes, {can_hold_one} can hold a bundle"
    else:
        needs = [f"{format_gpus(demand.gpu_units)} GPUs"] if demand.gpu_units else []
        needs += [f"{format_cpus(demand.cpu)} CPUs"] if demand.cpu else []
        needs += [f"{format_custom(units)} {name}" for name, units in demand.custom]
        why = f"it needs {' and '.join(needs)} over its nodes"  # never empty: bundles reserve something
    totals = _totals(ix, free) + _custom_totals(ix, demand, free)
    if free:
        message = (f"{group} does not fit the free capacity now ({why}; "
                   f"{totals}); it waits for resources to be released")
    else:
        message = f"{group} can never be placed: {why} ({totals})"
    return message, reasons
