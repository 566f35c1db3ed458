"""The placement group table of the cluster model: capacity snapshot, placement, removal.

The placement itself is pure (:mod:`podium.scheduler.core`); what a removal means for the
group's workers is the cluster model's to carry out
(:class:`~podium.scheduler.state.ClusterModel`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from podium import errors
from podium.limits import MAX_BUNDLES, check_count
from podium.resources import GPU_UNITS, BundleSpec, Strategy, cpu_units, parse_custom_resources, validate_bundles
from podium.scheduler import core
from podium.scheduler.nodes import NodeTable
from podium.scheduler.sessions import SessionTable
from podium.scheduler.tables import ChangeLog, RecordTable
from podium.v1 import common_pb2

__all__ = ["GroupTable", "placement_of"]

#: What placing a group gives: a placement, a reason it does not fit now, or never.
PlaceResult = core.Placement | core.Unavailable | core.Infeasible


class GroupTable(RecordTable[common_pb2.PlacementGroup]):
    """The placement groups by id, in creation order (pending ones are retried in it), with
    the free capacity of the alive nodes kept up to date.

    ``nodes`` is where groups are placed; ``sessions`` checks a group's owner; ``changes``
    is marked by every change; ``new_id`` makes group ids.
    """

    def __init__(self, changes: ChangeLog, nodes: NodeTable, sessions: SessionTable, *,
                 new_id: Callable[[str], str]) -> None:
        super().__init__()
        self._changes = changes
        self._nodes = nodes
        self._sessions = sessions
        self._new_id = new_id
        self._specs: dict[str, tuple[BundleSpec, ...]] = {}
        #: Name -> id of the live (not REMOVED) group of that name.
        self._live_names: dict[str, str] = {}
        #: The free capacity of the alive nodes (see :meth:`snapshot`), valid while the
        #: nodes' capacity epoch is the one it was built at; None: rebuild on next use.
        self._capacity: core.Snapshot | None = None
        self._capacity_epoch = -1

    def lookup(self, group_id: str = "", name: str = "") -> common_pb2.PlacementGroup:
        """A placement group by id or by name (exactly one), or NotFoundError.

        By name, the live (not REMOVED) group wins over removed ones of the same name.
        """
        if bool(group_id) == bool(name):
            raise errors.InvalidArgumentError("give exactly one of placement group id or name")
        if group_id:
            found = self._records.get(group_id)
            if found is None:
                raise errors.NotFoundError(f"unknown placement group id {group_id!r}")
            return found
        live = self._live_names.get(name)
        if live is not None:
            return self._records[live]
        matches = [g for g in self._records.values() if g.name == name]
        if not matches:
            raise errors.NotFoundError(f"unknown placement group name {name!r}")
        return matches[-1]

    def bundles(self, group_id: str) -> tuple[BundleSpec, ...]:
        """The checked bundles of a remembered group (KeyError for an unknown id)."""
        return self._specs[group_id]

    def snapshot(self) -> core.Snapshot:
        """The alive nodes with every CREATED group's reservations taken off.

        Kept up to date as groups are placed and removed (``core.apply``/``core.release``
        touch only the nodes of that group); rebuilt from the records, O(groups + nodes),
        only after a node came, went or changed its capacity. On 1,000 nodes a rebuild
        takes tens of milliseconds, an update tens of microseconds.
        """
        cached = self._capacity
        epoch = self._nodes.capacity_epoch
        if cached is None or self._capacity_epoch != epoch:
            cached = self._capacity = self.build_snapshot()
            self._capacity_epoch = epoch
        return cached

    def build_snapshot(self) -> core.Snapshot:
        """The snapshot built from the records alone (what :meth:`snapshot` keeps)."""
        cpu_used: dict[str, int] = {}
        gpu_used: dict[tuple[str, int], int] = {}
        custom_used: dict[tuple[str, str], int] = {}
        for group in self._records.values():
            if group.state != common_pb2.PG_CREATED:
                continue
            specs = self._specs[group.id]
            for placed in group.placements:
                spec = specs[placed.bundle_index]
                cpu_used[placed.node_id] = cpu_used.get(placed.node_id, 0) + spec.cpu_units
                for name, units in spec.custom:
                    custom_used[(placed.node_id, name)] = custom_used.get((placed.node_id, name), 0) + units
                if spec.is_fractional:
                    per_gpu = spec.gpu_units
                else:
                    per_gpu = GPU_UNITS
                for index in placed.gpu_indices:
                    key = (placed.node_id, index)
                    gpu_used[key] = gpu_used.get(key, 0) + per_gpu
        views = []
        # Order carries no meaning to the core (it sorts by address itself).
        for node in self._nodes.values():
            if node.state != common_pb2.NODE_ALIVE:
                continue
            info = node.info
            total_cpu = _total_cpu_units(info.cpus)
            gpus = tuple(core.GpuView(index=g.index, uuid=g.uuid,
                                      free_units=max(0, GPU_UNITS - gpu_used.get((info.node_id, g.index), 0)),
                                      memory_total_bytes=g.memory_total_bytes)
                         for g in info.gpus)
            custom = _custom_of(info)
            views.append(core.NodeView(node_id=info.node_id, address=info.address,
                                       total_cpu_units=total_cpu,
                                       free_cpu_units=max(0, total_cpu - cpu_used.get(info.node_id, 0)),
                                       gpus=gpus, custom_total=custom,
                                       custom_free=tuple((name, max(0, units - custom_used.get(
                                           (info.node_id, name), 0))) for name, units in custom)))
        return core.Snapshot(tuple(views))

    def _track_capacity(self, group: common_pb2.PlacementGroup, placement: core.Placement,
                        sign: int) -> None:
        """Take (sign -1) or give back (+1) a group's resources in the kept snapshot."""
        snapshot = self._capacity
        if snapshot is None or self._capacity_epoch != self._nodes.capacity_epoch:
            return  # rebuilt from the records on next use
        request = core.PlacementRequest(self._specs[group.id], Strategy(group.strategy))
        try:
            change = core.apply if sign < 0 else core.release
            self._capacity = change(snapshot, placement, request)
        except errors.PodiumError:
            # The records and the snapshot disagree (a node re-registered with other
            # GPUs under a group): the records are the truth, rebuild from them.
            self._capacity = None

    def _place(self, group: common_pb2.PlacementGroup, snapshot: core.Snapshot) -> PlaceResult:
        return core.place(core.PlacementRequest(self._specs[group.id], Strategy(group.strategy)),
                          snapshot)

    def _apply_placement(self, group: common_pb2.PlacementGroup, placement: core.Placement) -> None:
        del group.placements[:]
        for a in placement.assignments:
            info = self._nodes[a.node_id].info
            uuids = {g.index: g.uuid for g in info.gpus}
            group.placements.add(bundle_index=a.bundle_index, node_id=a.node_id,
                                 node_address=info.address, gpu_indices=list(a.gpu_indices),
                                 gpu_uuids=[uuids.get(i, "") for i in a.gpu_indices])
        group.state = common_pb2.PG_CREATED
        group.reason = ""
        self._changes.touch(groups=[group.id])
        self._track_capacity(group, placement, -1)

    def promote_pending(self) -> list[str]:
        """Retry pending groups in creation order; ids of those now CREATED."""
        pending = [g for g in self._records.values() if g.state == common_pb2.PG_PENDING]
        if not pending:
            return []
        created = []
        snapshot = self.snapshot()
        for group in pending:
            if not snapshot.nodes:
                reason = "no alive nodes"
            else:
                result = self._place(group, snapshot)
                if isinstance(result, core.Placement):
                    self._apply_placement(group, result)
                    created.append(group.id)
                    snapshot = self.snapshot()
                    continue
                reason = _reason_text(result)
            if group.reason != reason:
                group.reason = reason
                self._changes.touch(groups=[group.id])
        return created

    def create(self, name: str, bundles: Sequence[dict], strategy: int,
               detached: bool, owner: str, now: float, *,
               specs: tuple[BundleSpec, ...] | None = None,
               placed: tuple[core.Snapshot, PlaceResult] | None = None
               ) -> common_pb2.PlacementGroup:
        """Create a group: CREATED when it fits now, PENDING when it fits the cluster
        only once capacity frees; InfeasibleError (with per-node reasons) when no
        set of alive nodes can ever hold it. With no alive node at all it is PENDING.

        ``specs`` (``validate_bundles(bundles)``) and ``placed`` (a snapshot and
        ``core.place``'s answer on it) let the service do that costly, pure work on a
        thread; ``placed`` is used only while the capacity still equals its snapshot.
        """
        if not name:
            raise errors.InvalidArgumentError("placement group name is required")
        check_count(len(bundles), MAX_BUNDLES, f"placement group {name!r}: bundles")
        specs = validate_bundles(bundles) if specs is None else specs
        strat = Strategy.parse(strategy)
        if detached:
            owner = ""
        elif owner:
            self._sessions.lookup(owner)
        if name in self._live_names:
            raise errors.AlreadyExistsError(f"placement group name {name!r} is already taken")
        group = common_pb2.PlacementGroup(id=self._new_id("pg"), name=name,
                                          strategy=common_pb2.Strategy.ValueType(int(strat)),
                                          state=common_pb2.PG_PENDING, detached=detached,
                                          owner=owner, created_at=now)
        for spec in specs:
            group.bundles.add(resources=spec.to_resources())
        snapshot = self.snapshot()
        result: PlaceResult | None
        if not snapshot.nodes:
            result = None
        else:
            if placed is not None and placed[0] is snapshot:
                result = placed[1]
            else:
                result = core.place(core.PlacementRequest(specs, strat), snapshot)
            if isinstance(result, core.Infeasible):
                raise errors.InfeasibleError(
                    f"placement group {name!r} can never fit: {result.message}",
                    node_reasons=dict(result.node_reasons))
        self._records[group.id] = group
        self._specs[group.id] = specs
        self._live_names[name] = group.id
        self._changes.touch(groups=[group.id])
        if isinstance(result, core.Placement):
            self._apply_placement(group, result)
        else:
            group.reason = "no alive nodes" if result is None else _reason_text(result)
        return group

    def remove(self, group: common_pb2.PlacementGroup, reason: str) -> None:
        """Mark a group REMOVED with ``reason`` and give its capacity back (its workers are
        the caller's to stop)."""
        if group.state == common_pb2.PG_CREATED:
            self._track_capacity(group, placement_of(group), +1)
        if self._live_names.get(group.name) == group.id:
            del self._live_names[group.name]
        group.state = common_pb2.PG_REMOVED
        group.reason = reason
        self._changes.touch(groups=[group.id])

    def placed_on(self, node_id: str) -> list[common_pb2.PlacementGroup]:
        """The CREATED groups with a bundle on a node."""
        return [g for g in self._records.values()
                if g.state == common_pb2.PG_CREATED and any(p.node_id == node_id for p in g.placements)]

    def owned_by(self, session_id: str) -> list[common_pb2.PlacementGroup]:
        """The groups that die with a session: its own, not detached, not yet REMOVED."""
        return [g for g in self._records.values()
                if g.owner == session_id and not g.detached and g.state != common_pb2.PG_REMOVED]

    def prune(self, keep: int) -> None:
        """Forget the oldest REMOVED groups beyond ``keep``."""
        removed = [g.id for g in self._records.values() if g.state == common_pb2.PG_REMOVED]
        for group_id in removed[:max(0, len(removed) - keep)]:
            del self._records[group_id]
            del self._specs[group_id]
            self._changes.touch(groups=[group_id])

    def restore(self, groups: Iterable[common_pb2.PlacementGroup]) -> None:
        """Load persisted groups (in any order: they are kept in creation order)."""
        for group in sorted(groups, key=lambda g: g.created_at):
            self._records[group.id] = group
            self._specs[group.id] = validate_bundles([dict(b.resources) for b in group.bundles])
            if group.state != common_pb2.PG_REMOVED:
                self._live_names[group.name] = group.id
        self._capacity = None

    @staticmethod
    def pending_text(group: common_pb2.PlacementGroup) -> str:
        """Why a group is still pending, for a DeadlineExceeded message."""
        return group.reason or "waiting for capacity"


def placement_of(group: common_pb2.PlacementGroup) -> core.Placement:
    """A CREATED group's placements as the core's Placement (bundle order)."""
    return core.Placement(tuple(
        core.BundleAssignment(p.bundle_index, p.node_id, tuple(p.gpu_indices))
        for p in sorted(group.placements, key=lambda p: p.bundle_index)))


def _total_cpu_units(cpus: float) -> int:
    return cpu_units(cpus) if math.isfinite(cpus) and cpus >= 0 else 0


def _custom_of(info: common_pb2.NodeInfo) -> tuple[tuple[str, int], ...]:
    # Checked at registration; a record from an older state file that fails offers none.
    try:
        return parse_custom_resources(dict(info.resources))
    except errors.InvalidSpecError:
        return ()


def _reason_text(result) -> str:
    reasons = "; ".join(f"{node}: {why}" for node, why in sorted(result.node_reasons.items()))
    return f"{result.message} ({reasons})" if reasons else result.message
