"""The four placement strategies (Ray's semantics) as searches over a capacity index.

Each ``place_*`` function returns, per bundle in bundle order, ``(rank, gpu_indices)``
where rank names a node of the index, or None when the bundles do not all fit. They
are atomic by construction: nothing is written anywhere, the caller turns a full
answer into a Placement.

* STRICT_PACK: every bundle on one node; the tightest node that fits (best fit),
  so a group of 4 leaves an 8-GPU node whole for a later group of 8.
* PACK: the tightest single node that holds everything; otherwise fill nodes
  greedily, the emptiest first, so as few nodes as possible are used.
* SPREAD: one bundle per node over the emptiest nodes, round after round; a node
  gets a second bundle only once every usable node has one.
* STRICT_SPREAD: every bundle on its own node; larger bundles choose first, each
  the tightest node left that fits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from podium.resources import GPU_UNITS, BundleSpec, Strategy
from podium.scheduler.core.fit import NodeFill, fill_order
from podium.scheduler.core.index import CapacityIndex, Summary

__all__ = ["Demand", "attempt"]

Answer = list[tuple[int, tuple[int, ...]]]


class Demand(NamedTuple):
    """What a set of bundles needs from ONE node, in the index's terms."""

    idle_gpus: int      # whole GPUs (sum over whole-GPU bundles)
    fraction: int       # units of the largest fractional bundle (0: none)
    cpu: int            # CPU units, summed
    gpu_units: int      # GPU units, summed
    custom: tuple[tuple[str, int], ...] = ()  # custom resource units, summed (sorted by name)

    @classmethod
    def of(cls, bundles: Sequence[BundleSpec]) -> "Demand":
        """The demand of all ``bundles`` together."""
        idle = fraction = cpu = units = 0
        custom: dict[str, int] = {}
        for b in bundles:
            for name, need in b.custom:
                custom[name] = custom.get(name, 0) + need
            g = b.gpu_units
            units += g
            cpu += b.cpu_units
            if g >= GPU_UNITS:
                idle += g // GPU_UNITS
            elif g > fraction:
                fraction = g
        return cls(idle, fraction, cpu, units, tuple(sorted(custom.items())))

    def may_fit(self, s: Summary) -> bool:
        """A necessary condition for a node with Summary ``s`` (cheap pre-check)."""
        if s.idle_gpus < self.idle_gpus or s.free_cpu < self.cpu or s.free_gpu_units < self.gpu_units:
            return False
        if self.fraction and s.largest_partial < self.fraction and s.idle_gpus <= self.idle_gpus:
            return False
        return True


def place_strict_pack(ix: CapacityIndex, bundles: Sequence[BundleSpec]) -> Answer | None:
    """All bundles on the tightest node that holds them all."""
    demand = Demand.of(bundles)
    order = fill_order(bundles)
    summaries = ix.summaries
    for rank in ix.best_fit(demand.idle_gpus, demand.fraction, demand.cpu):
        if not demand.may_fit(summaries[rank]):
            continue
        got = NodeFill(ix.views[rank]).take_group(bundles, order)
        if got is not None:
            return [(rank, got[i]) for i in range(len(bundles))]
    return None


def _floor_of(bundles: Sequence[BundleSpec]) -> tuple[int, bool, int]:
    # The least any useful node offers: an idle GPU when every bundle needs whole
    # GPUs; for CPU-only groups, the smallest bundle's CPU.
    cpu_only = all(b.gpu_units == 0 for b in bundles)
    idle_floor = 1 if all(b.gpu_units >= GPU_UNITS for b in bundles) else 0
    min_cpu = min(b.cpu_units for b in bundles)
    return idle_floor, cpu_only, min_cpu


def _smallest(bundles: Sequence[BundleSpec]) -> Demand:
    # A node that cannot hold this much can hold no bundle of the group.
    return Demand(idle_gpus=min(b.gpu_units // GPU_UNITS for b in bundles),
                  fraction=0, cpu=min(b.cpu_units for b in bundles),
                  gpu_units=min(b.gpu_units for b in bundles))


def place_pack(ix: CapacityIndex, bundles: Sequence[BundleSpec]) -> Answer | None:
    """One node if any holds everything; else the emptiest nodes, filled in turn."""
    one = place_strict_pack(ix, bundles)
    if one is not None:
        return one
    idle_floor, cpu_only, min_cpu = _floor_of(bundles)
    smallest = _smallest(bundles)
    summaries = ix.summaries
    remaining = fill_order(bundles)
    answer: list = [None] * len(bundles)
    for rank in ix.most_free(idle_floor, cpu_only, min_cpu):
        if not smallest.may_fit(summaries[rank]):
            continue
        fill = NodeFill(ix.views[rank])
        left = []
        for i in remaining:
            gpus = fill.take(bundles[i])
            if gpus is None:
                left.append(i)
            else:
                answer[i] = (rank, gpus)
        remaining = left
        if not remaining:
            return answer
    return None


def place_spread(ix: CapacityIndex, bundles: Sequence[BundleSpec]) -> Answer | None:
    """Round-robin over the emptiest nodes; reuse a node only in a later round."""
    idle_floor, cpu_only, min_cpu = _floor_of(bundles)
    smallest = _smallest(bundles)
    summaries = ix.summaries
    remaining = list(range(len(bundles)))
    answer: list = [None] * len(bundles)
    fills: dict[int, NodeFill] = {}
    visited: list[int] = []

    def offer(rank: int) -> bool:
        # Give this node the first remaining bundle it can hold.
        fill = fills.get(rank)
        if fill is None:
            fill = fills[rank] = NodeFill(ix.views[rank])
        tried: set[BundleSpec] = set()
        for pos, i in enumerate(remaining):
            b = bundles[i]
            if b in tried:  # an identical bundle already failed here
                continue
            gpus = fill.take(b)
            if gpus is not None:
                answer[i] = (rank, gpus)
                del remaining[pos]
                return True
            tried.add(b)
        return False

    for rank in ix.most_free(idle_floor, cpu_only, min_cpu):
        if not smallest.may_fit(summaries[rank]):
            continue
        visited.append(rank)
        offer(rank)
        if not remaining:
            return answer
    while remaining:
        placed = False
        for rank in visited:
            if offer(rank):
                placed = True
                if not remaining:
                    return answer
        if not placed:
            return None
    return answer


def place_strict_spread(ix: CapacityIndex, bundles: Sequence[BundleSpec]) -> Answer | None:
    """Each bundle on a distinct node; the largest bundles choose first, tightest fit."""
    if len(bundles) > len(ix):
        return None
    order = sorted(range(len(bundles)),
                   key=lambda i: (-bundles[i].gpu_units, -bundles[i].cpu_units, i))
    summaries = ix.summaries
    used: set[int] = set()
    answer: list = [None] * len(bundles)
    candidates: Iterable[int] = ()
    previous: BundleSpec | None = None
    for i in order:
        b = bundles[i]
        if b != previous:
            # Identical bundles share one walk: a node an equal bundle skipped
            # cannot hold this one either.
            demand = Demand.of((b,))
            candidates = ix.best_fit(demand.idle_gpus, demand.fraction, demand.cpu)
            previous = b
        for rank in candidates:
            if rank in used or not demand.may_fit(summaries[rank]):
                continue
            gpus = NodeFill(ix.views[rank]).take(b)
            if gpus is not None:
                used.add(rank)
                answer[i] = (rank, gpus)
                break
        else:
            return None
    return answer


_STRATEGIES = {
    Strategy.STRICT_PACK: place_strict_pack,
    Strategy.PACK: place_pack,
    Strategy.SPREAD: place_spread,
    Strategy.STRICT_SPREAD: place_strict_spread,
}


def attempt(ix: CapacityIndex, bundles: Sequence[BundleSpec], strategy: Strategy) -> Answer | None:
    """Place ``bundles`` with ``strategy`` on the capacity ``ix`` describes, or None."""
    return _STRATEGIES[strategy](ix, bundles)
