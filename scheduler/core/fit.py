"""Filling one node with bundles: which concrete GPUs each bundle owns.

The rules (see docs/architecture.md, "The scheduler's state"):

* CPU is a node-level pool, and so is each custom resource (``nvlink_domain_0``, ``memory``).
* A fractional bundle takes units from ONE GPU: the best fit, i.e. the GPU with the
  least free units that still fits, lowest index on ties. So fractions stack on a
  partly used GPU before they open an idle one.
* A bundle of n whole GPUs takes n idle GPUs, lowest indices first.

A group on one node is filled whole-GPU bundles first (they need idle GPUs, which
fractions would otherwise break up), then fractions largest first (first-fit
decreasing packs better), then CPU-only bundles.
"""

from __future__ import annotations

from collections.abc import Sequence

from podium.resources import GPU_UNITS, BundleSpec
from podium.scheduler.core.views import NodeView

__all__ = ["NodeFill", "fill_order"]


def fill_order(bundles: Sequence[BundleSpec], indices: Sequence[int] | None = None) -> list[int]:
    """Bundle indices in the order a node is filled: whole GPUs, fractions (largest
    first), CPU-only; stable by bundle index within each kind."""
    if indices is None:
        indices = range(len(bundles))

    def key(i: int) -> tuple[int, int]:
        g = bundles[i].gpu_units
        if g >= GPU_UNITS:
            return (0, 0)
        if g > 0:
            return (1, -g)
        return (2, 0)

    return sorted(indices, key=key)


class NodeFill:
    """The working capacity of one node while one placement is being decided."""

    __slots__ = ("view", "cpu", "custom", "free", "total", "indices", "count")

    def __init__(self, view: NodeView) -> None:
        gpus = view.gpus_by_index
        self.view = view
        self.cpu = view.free_cpu_units
        self.custom = dict(view.custom_free)  # name -> free units
        self.free = [g.free_units for g in gpus]
        self.total = [g.total_units for g in gpus]
        self.indices = [g.index for g in gpus]
        self.count = 0  # bundles of the current request placed here

    def copy(self) -> "NodeFill":
        """An independent copy (to try a group and drop it if it fails)."""
        other = NodeFill.__new__(NodeFill)
        other.view = self.view
        other.cpu = self.cpu
        other.custom = self.custom.copy() if self.custom else self.custom
        other.free = self.free.copy()
        other.total = self.total
        other.indices = self.indices
        other.count = self.count
        return other

    @property
    def idle_gpus(self) -> int:
        """GPUs with nothing reserved."""
        return sum(1 for f, t in zip(self.free, self.total) if f >= t)

    @property
    def free_gpu_units(self) -> int:
        """Free GPU units over all GPUs."""
        return sum(self.free)

    @property
    def largest_free(self) -> int:
        """The most free units on any one GPU (0 without GPUs)."""
        return max(self.free, default=0)

    def take(self, bundle: BundleSpec) -> tuple[int, ...] | None:
        """Reserve one bundle here; its GPU indices, or None (and no change) if it does not fit."""
        if bundle.cpu_units > self.cpu:
            return None
        custom = self.custom
        for name, need in bundle.custom:
            if custom.get(name, 0) < need:
                return None
        units = bundle.gpu_units
        if units == 0:
            got: tuple[int, ...] = ()
        elif units < GPU_UNITS:
            best = -1
            best_free = 0
            for pos, free in enumerate(self.free):
                # Strict < keeps the lowest index among equally tight GPUs.
                if free >= units and (best < 0 or free < best_free):
                    best, best_free = pos, free
            if best < 0:
                return None
            self.free[best] -= units
            got = (self.indices[best],)
        else:
            n = units // GPU_UNITS
            picks = [pos for pos, free in enumerate(self.free) if free >= self.total[pos]]
            if len(picks) < n:
                return None
            picks = picks[:n]
            for pos in picks:
                self.free[pos] -= self.total[pos]
            got = tuple(self.indices[pos] for pos in picks)
        self.cpu -= bundle.cpu_units
        for name, need in bundle.custom:
            custom[name] -= need
        self.count += 1
        return got

    def take_group(self, bundles: Sequence[BundleSpec],
                   order: Sequence[int]) -> dict[int, tuple[int, ...]] | None:
        """Reserve every bundle of ``order`` here, or none: bundle index -> GPU indices."""
        trial = self.copy()
        got: dict[int, tuple[int, ...]] = {}
        for i in order:
            gpus = trial.take(bundles[i])
            if gpus is None:
                return None
            got[i] = gpus
        self.cpu, self.custom, self.free, self.count = trial.cpu, trial.custom, trial.free, trial.count
        return got

    def count_fitting(self, bundles: Sequence[BundleSpec], order: Sequence[int]) -> int:
        """How many of ``order`` this node alone would hold, filled greedily (no change)."""
        trial = self.copy()
        return sum(1 for i in order if trial.take(bundles[i]) is not None)
