"""Custom resources in the pure core: bundles ask for named node-level pools
(``nvlink_domain_0``, ``memory``), nodes offer them, and place/apply/release account for them
like CPUs, with the same Infeasible/Unavailable answer and a reason naming the resource."""

from __future__ import annotations

import pytest

from podium.errors import InvalidSpecError, ResourceExhaustedError
from podium.resources import (CUSTOM_UNITS, MAX_CUSTOM_RESOURCES, BundleSpec, Strategy,
                              parse_custom_resources)
from podium.scheduler.core import (Infeasible, NodeView, Placement, PlacementRequest, Snapshot,
                                   Unavailable, apply, place, release)

S = Strategy


def nv(node_id: str, address: str, *, gpus: int = 0, cpus: float = 8, **resources: float) -> NodeView:
    return NodeView.idle(node_id, address, cpus=cpus, gpus=gpus, resources=resources)


def req(bundles: list[dict], strategy: Strategy = S.PACK) -> PlacementRequest:
    return PlacementRequest(tuple(bundles), strategy)


def test_bundle_parses_custom_resources_sorted_and_drops_zero() -> None:
    b = BundleSpec.from_resources({"CPU": 1, "zeta": 0.5, "nvlink_domain_0": 1, "none": 0})
    assert b.custom == (("nvlink_domain_0", CUSTOM_UNITS), ("zeta", CUSTOM_UNITS // 2))
    assert b.to_resources() == {"CPU": 1.0, "GPU": 0.0, "nvlink_domain_0": 1.0, "zeta": 0.5}
    assert "nvlink_domain_0: 1" in b.describe()
    # A bundle of a custom resource alone is a bundle (Ray allows it).
    assert BundleSpec.from_resources({"nvlink_domain_0": 1}).cpu_units == 0


@pytest.mark.parametrize("bad", [
    {"": 1}, {"has space": 1}, {"x": -1}, {"x": float("nan")}, {"x": True}, {"x": 2.0**51},
    {"x" * 129: 1}, {f"r{i}": 1 for i in range(MAX_CUSTOM_RESOURCES + 1)},
])
def test_bad_custom_resources_are_refused_by_name(bad: dict) -> None:
    with pytest.raises(InvalidSpecError):
        BundleSpec.from_resources({"CPU": 1, **bad})
    with pytest.raises(InvalidSpecError):
        parse_custom_resources(bad)


def test_only_nodes_offering_the_resource_take_the_bundle() -> None:
    a = nv("node-a", "10.0.0.1")
    b = nv("node-b", "10.0.0.2", nvlink_domain_0=1)
    out = place(req([{"CPU": 1, "nvlink_domain_0": 1}]), Snapshot.of(a, b))
    assert isinstance(out, Placement) and out.node_ids() == ("node-b",)


def test_strict_pack_needs_all_of_it_on_one_node() -> None:
    a = nv("node-a", "10.0.0.1", nvlink_domain_0=1)
    b = nv("node-b", "10.0.0.2", nvlink_domain_0=1)
    two = [{"CPU": 1, "nvlink_domain_0": 1}] * 2
    out = place(req(two, S.STRICT_PACK), Snapshot.of(a, b))
    assert isinstance(out, Infeasible)
    assert "nvlink_domain_0" in out.message and "2 nvlink_domain_0 in total" in out.message
    assert out.node_reasons["node-a"].startswith("1 nvlink_domain_0, bundle group needs 2")
    # PACK spreads it over the two nodes instead.
    out = place(req(two, S.PACK), Snapshot.of(a, b))
    assert isinstance(out, Placement) and sorted(out.node_ids()) == ["node-a", "node-b"]


def test_a_node_without_the_resource_is_infeasible_with_reason() -> None:
    out = place(req([{"CPU": 1, "tpu_slice": 1}]), Snapshot.of(nv("node-a", "10.0.0.1")))
    assert isinstance(out, Infeasible)
    assert out.node_reasons == {"node-a": "no tpu_slice, a bundle needs 1"}
    assert "can never be placed" in out.message


def test_fractions_stack_and_apply_release_account_exactly() -> None:
    snap = Snapshot.of(nv("node-a", "10.0.0.1", cpus=64, accel=1))
    third = req([{"CPU": 1, "accel": 1 / 3}])
    held = []
    for _ in range(3):
        out = place(third, snap)
        assert isinstance(out, Placement)
        snap = apply(snap, out, third)
        held.append(out)
    assert snap.node("node-a").custom_free == (("accel", 1),)  # 10000 - 3 * 3333
    out = place(req([{"CPU": 1, "accel": 0.5}]), snap)
    assert isinstance(out, Unavailable)
    assert "0.000 of 1 accel free" in out.message and "accel" in out.node_reasons["node-a"]
    with pytest.raises(ResourceExhaustedError):
        apply(snap, held[0], req([{"CPU": 1, "accel": 0.5}]))
    for placed in held:
        snap = release(snap, placed, third)
    assert snap.node("node-a").custom_free == (("accel", CUSTOM_UNITS),)
    assert isinstance(place(req([{"CPU": 1, "accel": 1}]), snap), Placement)


def test_strict_spread_and_spread_respect_custom_capacity() -> None:
    nodes = Snapshot.of(nv("node-a", "10.0.0.1", rack=2), nv("node-b", "10.0.0.2"),
                        nv("node-c", "10.0.0.3", rack=1))
    out = place(req([{"CPU": 1, "rack": 1}] * 2, S.STRICT_SPREAD), nodes)
    assert isinstance(out, Placement) and sorted(out.node_ids()) == ["node-a", "node-c"]
    out = place(req([{"CPU": 1, "rack": 1}] * 3, S.SPREAD), nodes)
    assert isinstance(out, Placement) and sorted(out.node_ids()) == ["node-a", "node-a", "node-c"]
    out = place(req([{"CPU": 1, "rack": 1}] * 4, S.SPREAD), nodes)
    assert isinstance(out, Infeasible)


def test_memory_is_a_resource_like_any_other() -> None:
    snap = Snapshot.of(nv("node-a", "10.0.0.1", memory=16 * 2**30))
    ask = req([{"CPU": 1, "memory": 10 * 2**30}])
    out = place(ask, snap)
    assert isinstance(out, Placement)
    snap = apply(snap, out, ask)
    assert isinstance(place(ask, snap), Unavailable)


def test_gpu_and_custom_together() -> None:
    a = nv("node-a", "10.0.0.1", gpus=4)
    b = nv("node-b", "10.0.0.2", gpus=4, nvlink_domain_0=4)
    out = place(req([{"CPU": 1, "GPU": 1, "nvlink_domain_0": 1}] * 4, S.STRICT_PACK), Snapshot.of(a, b))
    assert isinstance(out, Placement) and set(out.node_ids()) == {"node-b"}
    assert sorted(x.gpu_indices[0] for x in out.assignments) == [0, 1, 2, 3]
