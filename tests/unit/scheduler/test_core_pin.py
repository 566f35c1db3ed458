"""Bundles pinned to a node (``node:<id or address>``, Ray's node resource): parsing,
round trip through the user form, and place() restricted to that node."""

from __future__ import annotations

import pytest

from podium.errors import InvalidSpecError
from podium.resources import GPU_UNITS, BundleSpec, Strategy
from podium.scheduler.core import GpuView, Infeasible, NodeView, Placement, PlacementRequest, Snapshot, place


def node(node_id: str, address: str, gpus: int = 2) -> NodeView:
    return NodeView(node_id, address, 8000, 8000, tuple(GpuView(i, f"GPU-{node_id}-{i}", GPU_UNITS)
                                                        for i in range(gpus)))


SNAP = Snapshot.of(node("node-a", "10.0.0.1"), node("node-b", "10.0.0.2"))


def test_node_key_parses_and_round_trips():
    spec = BundleSpec.from_resources({"CPU": 1, "node:10.0.0.2": 1})
    assert spec.node == "10.0.0.2" and spec.cpu_units == 1000
    assert BundleSpec.from_resources(spec.to_resources()) == spec
    assert "node:10.0.0.2" not in BundleSpec.from_resources({"CPU": 1}).to_resources()
    with pytest.raises(InvalidSpecError):
        BundleSpec.from_resources({"CPU": 1, "node:a": 1, "node:b": 1})
    with pytest.raises(InvalidSpecError):
        BundleSpec.from_resources({"CPU": 1, "node:": 1})


@pytest.mark.parametrize("pin", ["node-b", "10.0.0.2"])
def test_pinned_bundles_land_on_that_node(pin):
    # Unpinned, PACK picks the first node in address order; pinned, only node-b is considered.
    free = place(PlacementRequest((BundleSpec.from_resources({"CPU": 1, "GPU": 1}),), Strategy.PACK), SNAP)
    assert isinstance(free, Placement) and free.assignments[0].node_id == "node-a"
    spec = BundleSpec.from_resources({"CPU": 1, "GPU": 1, f"node:{pin}": 1})
    out = place(PlacementRequest((spec, spec), Strategy.PACK), SNAP)
    assert isinstance(out, Placement) and {a.node_id for a in out.assignments} == {"node-b"}


def test_pins_that_cannot_hold_are_infeasible_with_a_reason():
    unknown = BundleSpec.from_resources({"CPU": 1, "node:10.9.9.9": 1})
    out = place(PlacementRequest((unknown,), Strategy.PACK), SNAP)
    assert isinstance(out, Infeasible) and "10.9.9.9" in out.message
    a, b = (BundleSpec.from_resources({"CPU": 1, f"node:{n}": 1}) for n in ("node-a", "node-b"))
    assert isinstance(place(PlacementRequest((a, b), Strategy.SPREAD), SNAP), Infeasible)
    too_big = BundleSpec.from_resources({"CPU": 1, "GPU": 3, "node:node-a": 1})
    assert isinstance(place(PlacementRequest((too_big,), Strategy.PACK), SNAP), Infeasible)
