"""apply()/release(), the capacity index they carry forward, and properties of place()
checked on random clusters (hypothesis)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from podium.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from podium.resources import GPU_UNITS, BundleSpec, Strategy
from podium.scheduler.core import (BundleAssignment, GpuView, Infeasible, NodeView, Placement,
                                   PlacementRequest, Snapshot, Unavailable, apply, place, release)
from podium.scheduler.core.index import CapacityIndex, index_of

S = Strategy


def node(node_id, address, *, gpus=8, cpus=16, used=None, cpu_used=0):
    """A node with ``used[i]`` of GPU i reserved (a fraction of it)."""
    used = used or {}
    return NodeView(node_id, address, round(cpus * 1000), round((cpus - cpu_used) * 1000),
                    tuple(GpuView(i, f"GPU-{node_id}-{i}",
                                  GPU_UNITS - round(used.get(i, 0) * GPU_UNITS))
                          for i in range(gpus)))


def req(n, strategy, **resources):
    return PlacementRequest((BundleSpec.from_resources(resources or {"CPU": 1, "GPU": 1}),) * n,
                            strategy)


def assert_index_matches_rebuild(snap: Snapshot) -> None:
    """The index carried forward equals one built from scratch on the same nodes."""
    carried = index_of(snap)
    fresh = CapacityIndex.build(Snapshot(snap.nodes))
    for name in ("views", "summaries", "ranks", "positions", "partial", "cpu", "max_idle",
                 "total_gpus", "total_cpu", "free_gpu_units", "free_cpu"):
        assert getattr(carried, name) == getattr(fresh, name), name
    assert {k: v for k, v in carried.whole.items() if v} == {k: v for k, v in fresh.whole.items() if v}


def test_apply_takes_and_release_gives_back():
    snap = Snapshot.of(node("node-a", "10.0.0.1", gpus=2, cpus=4))
    request = PlacementRequest((BundleSpec.from_resources({"CPU": 1, "GPU": 1}),
                                BundleSpec.from_resources({"CPU": 1, "GPU": 0.5})), S.STRICT_PACK)
    placement = place(request, snap)
    taken = apply(snap, placement, request)
    a = taken.node("node-a")
    # 1 + 1 CPUs of 4 -> 2 free; GPU 0 all taken, GPU 1 half taken.
    assert a.free_cpu_units == 2000
    assert [g.free_units for g in a.gpus] == [0, GPU_UNITS // 2]
    assert snap.node("node-a").free_cpu_units == 4000  # the input is unchanged
    back = release(taken, placement, request)
    assert back == snap
    assert_index_matches_rebuild(taken)
    assert_index_matches_rebuild(back)


def test_apply_keeps_node_order_and_shares_untouched_nodes():
    nodes = (node("node-b", "10.0.0.2"), node("node-a", "10.0.0.1"), node("node-c", "10.0.0.3"))
    snap = Snapshot(nodes)
    request = req(8, S.STRICT_PACK)
    taken = apply(snap, place(request, snap), request)
    assert [n.node_id for n in taken.nodes] == ["node-b", "node-a", "node-c"]
    assert taken.nodes[0] is nodes[0] and taken.nodes[2] is nodes[2]
    assert taken.nodes[1].free_cpu_units == 8000


def test_apply_refuses_a_stale_placement():
    snap = Snapshot.of(node("node-a", "10.0.0.1", gpus=4))
    request = req(4, S.STRICT_PACK)
    placement = place(request, snap)
    taken = apply(snap, placement, request)
    with pytest.raises(ResourceExhaustedError, match="GPU 0 has 0 free"):
        apply(taken, placement, request)
    with pytest.raises(InvalidArgumentError, match="released twice"):
        release(snap, placement, request)


def test_apply_checks_the_placement_matches_the_request():
    snap = Snapshot.of(node("node-a", "10.0.0.1", gpus=4))
    request = req(2, S.STRICT_PACK)
    placement = place(request, snap)
    with pytest.raises(InvalidArgumentError, match="2 assignments for 3 bundles"):
        apply(snap, placement, req(3, S.STRICT_PACK))
    swapped = Placement(tuple(reversed(placement.assignments)))
    with pytest.raises(InvalidArgumentError, match="bundle order"):
        apply(snap, swapped, request)
    one = PlacementRequest((BundleSpec.from_resources({"GPU": 1}),), S.PACK)
    for gpus, error in [((0, 1), InvalidArgumentError), ((9,), NotFoundError)]:
        with pytest.raises(error):
            apply(snap, Placement((BundleAssignment(0, "node-a", gpus),)), one)
    with pytest.raises(NotFoundError, match="node-x"):
        apply(snap, Placement((BundleAssignment(0, "node-x", (0,)),)), one)


def test_release_skips_nodes_that_are_gone():
    a, b = node("node-a", "10.0.0.1", gpus=1), node("node-b", "10.0.0.2", gpus=1)
    request = req(2, S.STRICT_SPREAD)
    snap = Snapshot.of(a, b)
    placement = place(request, snap)
    taken = apply(snap, placement, request)
    # node-b died: the service rebuilds the snapshot without it, then releases the group.
    survivors = Snapshot((taken.node("node-a"),))
    assert release(survivors, placement, request) == Snapshot((a,))


def test_duplicate_node_ids_are_refused():
    snap = Snapshot.of(node("node-a", "10.0.0.1"), node("node-a", "10.0.0.2"))
    with pytest.raises(InvalidArgumentError, match="twice"):
        place(req(1, S.PACK), snap)


def test_many_groups_in_sequence_then_all_released():
    # 4 nodes x 8 GPUs = 32 GPUs; place several groups in sequence, then release them
    # all in random order: the snapshot is exactly the idle one again.
    snap0 = Snapshot(tuple(node(f"node-{i}", f"10.0.0.{i}") for i in range(4)))
    snap = snap0
    live = []
    for request in [req(8, S.STRICT_PACK), req(8, S.STRICT_PACK), req(4, S.PACK),
                    req(4, S.SPREAD), req(2, S.STRICT_SPREAD), req(2, S.PACK, GPU=0.5),
                    req(3, S.STRICT_PACK, GPU=1 / 3, CPU=1)]:
        result = place(request, snap)
        assert isinstance(result, Placement), result
        snap = apply(snap, result, request)
        live.append((result, request))
        assert_index_matches_rebuild(snap)
    # Whole GPUs: 8 + 8 + 4 + 4 + 2 = 26; two halves share one GPU, three thirds
    # another: 28 of 32 GPUs taken -> 4 free, and no node has 8 idle for another group.
    assert index_of(snap).free_gpu_units == 4 * GPU_UNITS
    assert isinstance(place(req(8, S.STRICT_PACK), snap), Unavailable)
    random.Random(7).shuffle(live)
    for result, request in live:
        snap = release(snap, result, request)
        assert_index_matches_rebuild(snap)
    assert snap == snap0


# ---------------------------------------------------------------- random clusters

BUNDLES = [{"GPU": 1}, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 2}, {"CPU": 2, "GPU": 0.5},
           {"GPU": 1 / 3}, {"CPU": 3}, {"CPU": 1, "GPU": 0.25}]
FRACTIONS_USED = [0, 0, 0.25, 1 / 3, 0.5, 1]


@st.composite
def clusters(draw):
    n = draw(st.integers(0, 5))
    hosts = draw(st.lists(st.sampled_from(["10.0.0.9", "10.0.0.10", "10.0.1.1", "::1", "host-a",
                                           "host-b", "127.0.0.2"]), min_size=n, max_size=n))
    nodes = []
    for i, host in enumerate(hosts):
        gpus = draw(st.integers(0, 4))
        cpus = draw(st.integers(0, 12))
        used = {g: draw(st.sampled_from(FRACTIONS_USED)) for g in range(gpus)}
        nodes.append(node(f"n{i}", host, gpus=gpus, cpus=cpus, used=used,
                          cpu_used=draw(st.integers(0, cpus))))
    return nodes


requests = st.builds(
    lambda bundles, strategy: PlacementRequest(
        tuple(BundleSpec.from_resources(b) for b in bundles), strategy),
    st.lists(st.sampled_from(BUNDLES), min_size=1, max_size=6),
    st.sampled_from(list(Strategy)))


def idle(snap: Snapshot) -> Snapshot:
    return Snapshot(tuple(n.as_idle() for n in snap.nodes))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), requests)
def test_place_properties(nodes, request):
    snap = Snapshot(tuple(nodes))
    result = place(request, snap)
    # Same answer whatever order the nodes come in.
    assert place(request, Snapshot(tuple(reversed(nodes)))) == result
    if not isinstance(result, Placement):
        assert set(result.node_reasons) == {n.node_id for n in nodes}
        assert result.message
        on_idle = place(request, idle(snap))
        if isinstance(result, Infeasible):
            assert isinstance(on_idle, Infeasible)   # decided on total capacity
        else:
            assert isinstance(on_idle, Placement)    # would fit an idle cluster: wait
        return
    used = result.node_ids()
    assert [a.bundle_index for a in result.assignments] == list(range(len(request.bundles)))
    if request.strategy is S.STRICT_PACK:
        assert len(set(used)) == 1
    if request.strategy is S.STRICT_SPREAD:
        assert len(set(used)) == len(used)
    if request.strategy is S.PACK and isinstance(place(PlacementRequest(request.bundles,
                                                                        S.STRICT_PACK), snap),
                                                 Placement):
        assert len(set(used)) == 1  # one node when one node can hold everything
    if request.strategy is S.SPREAD and len(set(request.bundles)) == 1:
        # Identical bundles: every node that can hold one gets one before any gets two.
        holders = sum(isinstance(place(PlacementRequest(request.bundles[:1], S.PACK),
                                       Snapshot((n,))), Placement) for n in nodes)
        assert len(set(used)) == min(len(used), holders)
    # GPU ownership: whole-GPU bundles of the group never share a GPU with anything.
    owners: dict[tuple[str, int], list[BundleSpec]] = {}
    for a, b in zip(result.assignments, request.bundles):
        assert len(a.gpu_indices) == b.gpus_needed
        for g in a.gpu_indices:
            owners.setdefault((a.node_id, g), []).append(b)
    for shared in owners.values():
        if len(shared) > 1:
            assert all(b.is_fractional for b in shared)
            assert sum(b.gpu_units for b in shared) <= GPU_UNITS
    # It really fits (apply checks every unit), and release restores the snapshot.
    taken = apply(snap, result, request)
    assert_index_matches_rebuild(taken)
    assert release(taken, result, request) == snap


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.lists(requests, min_size=1, max_size=12), st.randoms(use_true_random=False))
def test_index_stays_consistent_over_apply_release_chains(nodes, stream, rng):
    snap = Snapshot(tuple(nodes))
    start = snap
    live = []
    for request in stream:
        result = place(request, snap)
        if isinstance(result, Placement):
            snap = apply(snap, result, request)
            live.append((result, request))
        elif live and rng.random() < 0.5:
            done = live.pop(rng.randrange(len(live)))
            snap = release(snap, *done)
        assert_index_matches_rebuild(snap)
    for done in live:
        snap = release(snap, *done)
    assert snap == start
