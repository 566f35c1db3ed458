"""A capacity index over a snapshot, so placement looks at a few nodes, not all of them.

Nodes are numbered by *rank*: their position in address order (sort_key_address, then
node id), which is also the order every tie is broken in. Three sorted structures
point at ranks:

* ``whole[k]``: ranks of the nodes with exactly k idle GPUs, in address order. A
  group needing W whole GPUs on one node starts looking at bucket W (best fit) and
  walks up; SPREAD walks down from the emptiest nodes.
* ``partial``: ``(largest free units on a partly used GPU, rank)`` ascending, so a
  fractional bundle tries first the nodes whose roomiest partly used GPU fits it most
  tightly (the GPU inside the node is then chosen by best fit, see fit.py).
* ``cpu``: ``(free CPU units, rank)`` ascending, for CPU-only groups.

A snapshot builds its index once (O(n log n)); ``apply``/``release`` derive the next
snapshot's index copy-on-write, touching only the nodes a placement changed. The
index never changes once built, so an ``Iterator`` over it stays valid while a
placement attempt runs.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from podium.errors import InvalidArgumentError
from podium.resources import sort_key_address
from podium.scheduler.core.views import NodeView, Snapshot

__all__ = ["Summary", "CapacityIndex", "index_of", "summarize"]


class Summary(NamedTuple):
    """What a node can take right now, in the terms the index sorts by."""

    idle_gpus: int          # GPUs with nothing reserved on them
    largest_partial: int    # most free units on a partly used GPU (0: none)
    free_cpu: int           # free CPU units
    free_gpu_units: int     # free GPU units, all GPUs together


def summarize(view: NodeView) -> Summary:
    """The Summary of one node view."""
    idle = 0
    largest = 0
    units = 0
    for g in view.gpus:
        free = g.free_units
        units += free
        if free >= g.total_units:
            idle += 1
        elif free > largest:
            largest = free
    return Summary(idle, largest, view.free_cpu_units, units)


def _remove(sorted_list: list, item) -> None:
    # Items are unique (they carry the rank), so the bisect position is the item.
    del sorted_list[bisect_left(sorted_list, item)]


class CapacityIndex:
    """The index of one snapshot (see the module docstring). Treat it as immutable."""

    __slots__ = ("views", "summaries", "ranks", "positions", "whole", "partial", "cpu",
                 "max_idle", "total_gpus", "total_cpu", "free_gpu_units", "free_cpu",
                 "_idle_box")

    views: list[NodeView]
    summaries: list[Summary]
    ranks: dict[str, int]
    positions: list[int]
    whole: dict[int, list[int]]
    partial: list[tuple[int, int]]
    cpu: list[tuple[int, int]]
    max_idle: int
    total_gpus: int         # GPUs in the cluster
    total_cpu: int          # CPU units in the cluster
    free_gpu_units: int     # free GPU units, all nodes together
    free_cpu: int           # free CPU units, all nodes together
    _idle_box: list

    @classmethod
    def build(cls, snapshot: Snapshot) -> "CapacityIndex":
        """Index a snapshot from scratch."""
        keyed = sorted(((sort_key_address(n.address), n.node_id, pos)
                        for pos, n in enumerate(snapshot.nodes)))
        self = cls.__new__(cls)
        self.views = [snapshot.nodes[pos] for _, _, pos in keyed]
        self.positions = [pos for _, _, pos in keyed]
        self.ranks = {}
        for rank, view in enumerate(self.views):
            if view.node_id in self.ranks:
                raise InvalidArgumentError(f"snapshot lists node {view.node_id!r} twice")
            self.ranks[view.node_id] = rank
        self.summaries = [summarize(v) for v in self.views]
        self.whole = {}
        self.partial = []
        self.cpu = []
        for rank, s in enumerate(self.summaries):
            self.whole.setdefault(s.idle_gpus, []).append(rank)
            if s.largest_partial:
                self.partial.append((s.largest_partial, rank))
            self.cpu.append((s.free_cpu, rank))
        self.partial.sort()
        self.cpu.sort()
        self.max_idle = max((len(v.gpus) for v in self.views), default=0)
        self.total_gpus = sum(len(v.gpus) for v in self.views)
        self.total_cpu = sum(v.total_cpu_units for v in self.views)
        self.free_gpu_units = sum(s.free_gpu_units for s in self.summaries)
        self.free_cpu = sum(s.free_cpu for s in self.summaries)
        # Shared by every index derived from this one: the node set and the totals
        # never change along an apply()/release() chain, so neither does the idle view.
        self._idle_box = [None]
        return self

    def __len__(self) -> int:
        return len(self.views)

    def node_by_id(self, node_id: str) -> NodeView:
        """The view of a node by id (KeyError when absent)."""
        return self.views[self.ranks[node_id]]

    def replaced(self, changes: Mapping[int, NodeView]) -> "CapacityIndex":
        """A new index with the views at the given ranks replaced (copy-on-write)."""
        new = CapacityIndex.__new__(CapacityIndex)
        new.ranks = self.ranks
        new.positions = self.positions
        new.max_idle = self.max_idle
        new.total_gpus = self.total_gpus
        new.total_cpu = self.total_cpu
        new.free_gpu_units = self.free_gpu_units
        new.free_cpu = self.free_cpu
        new._idle_box = self._idle_box
        new.views = self.views.copy()
        new.summaries = self.summaries.copy()
        new.whole = dict(self.whole)
        new.partial = self.partial
        new.cpu = self.cpu
        copied: set[int] = set()
        partial_copied = cpu_copied = False
        for rank, view in changes.items():
            old = new.summaries[rank]
            now = summarize(view)
            new.views[rank] = view
            new.summaries[rank] = now
            new.free_gpu_units += now.free_gpu_units - old.free_gpu_units
            new.free_cpu += now.free_cpu - old.free_cpu
            if old.idle_gpus != now.idle_gpus:
                for k in (old.idle_gpus, now.idle_gpus):
                    if k not in copied:
                        new.whole[k] = list(new.whole.get(k, ()))
                        copied.add(k)
                _remove(new.whole[old.idle_gpus], rank)
                insort(new.whole[now.idle_gpus], rank)
            if old.largest_partial != now.largest_partial:
                if not partial_copied:
                    new.partial = new.partial.copy()
                    partial_copied = True
                if old.largest_partial:
                    _remove(new.partial, (old.largest_partial, rank))
                if now.largest_partial:
                    insort(new.partial, (now.largest_partial, rank))
            if old.free_cpu != now.free_cpu:
                if not cpu_copied:
                    new.cpu = new.cpu.copy()
                    cpu_copied = True
                _remove(new.cpu, (old.free_cpu, rank))
                insort(new.cpu, (now.free_cpu, rank))
        return new

    def idle_index(self) -> "CapacityIndex":
        """The index of the same cluster with nothing reserved (for feasibility)."""
        idle = self._idle_box[0]
        if idle is None:
            snap = Snapshot(tuple(v.as_idle() for v in self.views))
            idle = CapacityIndex.build(snap)
            idle._idle_box = [idle]
            self._idle_box[0] = idle
        return idle

    # -- candidate orders ---------------------------------------------------------

    def best_fit(self, idle_needed: int, fraction: int, cpu: int) -> Iterator[int]:
        """Ranks that may hold a demand, tightest first, ties in address order.

        ``idle_needed`` whole GPUs, ``fraction`` the largest fractional bundle's
        units (0: none), ``cpu`` the CPU units. Callers still check each node: this
        only orders and skips the nodes that obviously cannot help.
        """
        if idle_needed == 0 and fraction == 0:
            cpu_list = self.cpu
            for i in range(bisect_left(cpu_list, (cpu, -1)), len(cpu_list)):
                yield cpu_list[i][1]
            return
        seen: set[int] = set()
        start = idle_needed
        if fraction:
            partial = self.partial
            for i in range(bisect_left(partial, (fraction, -1)), len(partial)):
                rank = partial[i][1]
                seen.add(rank)
                yield rank
            # A node with no idle GPU can only offer a partly used one: seen above.
            start = max(idle_needed, 1)
        for k in range(start, self.max_idle + 1):
            for rank in self.whole.get(k, ()):
                if rank not in seen:
                    yield rank

    def most_free(self, idle_floor: int, cpu_only: bool, cpu: int) -> Iterator[int]:
        """Ranks from the emptiest node down (idle GPUs, or free CPU for CPU-only
        groups), ties in address order; stops below ``idle_floor`` idle GPUs or
        ``cpu`` free CPU units."""
        if cpu_only:
            cpu_list = self.cpu
            stop = bisect_left(cpu_list, (cpu, -1))
            i = len(cpu_list) - 1
            # Equal CPU runs are walked in address order, so ties break as everywhere.
            while i >= stop:
                j = i
                value = cpu_list[i][0]
                while j - 1 >= stop and cpu_list[j - 1][0] == value:
                    j -= 1
                for k in range(j, i + 1):
                    yield cpu_list[k][1]
                i = j - 1
            return
        for k in range(self.max_idle, idle_floor - 1, -1):
            yield from self.whole.get(k, ())


def index_of(snapshot: Snapshot) -> CapacityIndex:
    """The snapshot's index, built on first use and cached on the snapshot."""
    ix = snapshot._index
    if ix is None:
        ix = CapacityIndex.build(snapshot)
        object.__setattr__(snapshot, "_index", ix)
    return ix
