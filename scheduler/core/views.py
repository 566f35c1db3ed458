"""The data the scheduling core reads and returns: immutable views of the cluster.

Everything here is a frozen dataclass, so the service can hand the core a snapshot
and keep using it; :func:`podium.scheduler.core.apply` returns a new snapshot that
shares every node it did not touch (and the capacity index, updated in place of a
rebuild), which is what keeps placement fast on thousands of nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from collections.abc import Mapping

from podium.resources import GPU_UNITS, BundleSpec, Strategy, cpu_units, parse_custom_resources, validate_bundles

__all__ = ["GpuView", "NodeView", "Snapshot", "PlacementRequest", "BundleAssignment",
           "Placement", "Infeasible", "Unavailable"]


@dataclass(frozen=True)
class GpuView:
    """One GPU of a node: its NVML index and UUID, and how many units are free."""

    index: int
    uuid: str
    free_units: int
    total_units: int = GPU_UNITS
    memory_total_bytes: int = 0

    @property
    def is_idle(self) -> bool:
        """True when nothing holds any of it (a whole-GPU bundle may take it)."""
        return self.free_units >= self.total_units


@dataclass(frozen=True)
class NodeView:
    """One alive node: its CPU pool, its GPUs and its custom resources (node-level pools like
    CPU: ``(name, units)`` sorted by name), with free amounts in units."""

    node_id: str
    address: str
    total_cpu_units: int
    free_cpu_units: int
    gpus: tuple[GpuView, ...]
    custom_total: tuple[tuple[str, int], ...] = ()
    custom_free: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, tuple):
            object.__setattr__(self, "gpus", tuple(self.gpus))

    @classmethod
    def idle(cls, node_id: str, address: str, *, cpus: float, gpus: int,
             memory_total_bytes: int = 0, resources: Mapping[str, float] | None = None) -> "NodeView":
        """A node with nothing reserved: ``cpus`` CPUs, ``gpus`` GPUs indexed 0..gpus-1 and the
        custom ``resources`` (``{"nvlink_domain_0": 1}``)."""
        cpu = cpu_units(cpus)
        custom = parse_custom_resources(resources, what=f"node {node_id} resources")
        return cls(node_id=node_id, address=address, total_cpu_units=cpu, free_cpu_units=cpu,
                   gpus=tuple(GpuView(index=i, uuid=f"GPU-{node_id}-{i}", free_units=GPU_UNITS,
                                      memory_total_bytes=memory_total_bytes)
                              for i in range(gpus)),
                   custom_total=custom, custom_free=custom)

    @cached_property
    def gpus_by_index(self) -> tuple[GpuView, ...]:
        """The GPUs in NVML index order (the order ties are broken in)."""
        return tuple(sorted(self.gpus, key=lambda g: g.index))

    @cached_property
    def capacity_key(self) -> str:
        """Everything capacity-related: nodes with equal keys fit the same bundles (the
        reasons of a failed placement are worded once per key). A str, because a str
        caches its hash and a nested tuple is rehashed on every lookup."""
        gpus = ",".join(f"{g.free_units}/{g.total_units}" for g in self.gpus_by_index)
        key = f"{self.total_cpu_units}/{self.free_cpu_units}|{gpus}"
        if self.custom_total:
            key += f"|{self.custom_total}/{self.custom_free}"
        return key

    def as_idle(self) -> "NodeView":
        """The same node with everything free: the capacity feasibility is judged on."""
        return NodeView(node_id=self.node_id, address=self.address,
                        total_cpu_units=self.total_cpu_units, free_cpu_units=self.total_cpu_units,
                        gpus=tuple(GpuView(g.index, g.uuid, g.total_units, g.total_units,
                                           g.memory_total_bytes) for g in self.gpus),
                        custom_total=self.custom_total, custom_free=self.custom_total)


@dataclass(frozen=True)
class Snapshot:
    """The alive nodes at one moment. Order carries no meaning: ties between nodes are
    broken by :func:`podium.resources.sort_key_address` of the address, then node id."""

    nodes: tuple[NodeView, ...]
    # The capacity index (podium.scheduler.core.index), built on first use and carried
    # forward by apply()/release(); not part of the value.
    _index: Any = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, tuple):
            object.__setattr__(self, "nodes", tuple(self.nodes))

    @classmethod
    def of(cls, *nodes: NodeView) -> "Snapshot":
        """``Snapshot.of(a, b)`` == ``Snapshot((a, b))``."""
        return cls(tuple(nodes))

    def node(self, node_id: str) -> NodeView:
        """The node with this id (KeyError when absent)."""
        # The index (built on first placement) maps ids to views; this module sits below
        # the index, so without one it scans: snapshots are looked up by tests and tools,
        # placement itself goes through the index.
        if self._index is not None:
            return self._index.node_by_id(node_id)
        for view in self.nodes:
            if view.node_id == node_id:
                return view
        raise KeyError(node_id)


@dataclass(frozen=True)
class PlacementRequest:
    """A placement group to place: its bundles, in order, and the strategy.

    Bundles may be given as BundleSpecs or as user mappings (``{"CPU": 1, "GPU": 1}``)
    and the strategy as a name or wire int; both are validated here
    (InvalidSpecError: no bundles, a bad bundle, an unknown strategy).
    """

    bundles: tuple[BundleSpec, ...]
    strategy: Strategy

    def __post_init__(self) -> None:
        if not (isinstance(self.bundles, tuple)
                and all(type(b) is BundleSpec for b in self.bundles) and self.bundles):
            object.__setattr__(self, "bundles", validate_bundles(self.bundles))
        object.__setattr__(self, "strategy", Strategy.parse(self.strategy))


@dataclass(frozen=True)
class BundleAssignment:
    """Where one bundle landed: the node and the GPU indices it owns there."""

    bundle_index: int
    node_id: str
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """A successful placement: one assignment per bundle, in bundle order."""

    assignments: tuple[BundleAssignment, ...]

    def node_ids(self) -> tuple[str, ...]:
        """The node of each bundle, in bundle order."""
        return tuple(a.node_id for a in self.assignments)


@dataclass(frozen=True)
class Infeasible:
    """No set of the registered nodes could ever hold the request, even empty.

    ``node_reasons`` says, per node id, why that node cannot help (with numbers).
    """

    message: str
    node_reasons: dict[str, str]


@dataclass(frozen=True)
class Unavailable:
    """The request fits the cluster's total capacity but not what is free now: wait.

    ``node_reasons`` says, per node id, what is missing there right now.
    """

    message: str
    node_reasons: dict[str, str]
