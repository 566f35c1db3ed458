"""place(): the four strategies, Infeasible vs Unavailable, GPU ownership, tie-breaks.

Amounts in the comments are GPUs and CPUs; the code works in units (podium.resources).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from podium.resources import GPU_UNITS, BundleSpec, Strategy
from podium.scheduler.core import (GpuView, Infeasible, NodeView, Placement, PlacementRequest,
                                   Snapshot, Unavailable, apply, place)

S = Strategy


def node(node_id: str, address: str, *, gpus: int = 8, cpus: float = 16,
         used: dict[int, float] | None = None, cpu_used: float = 0) -> NodeView:
    """A node with ``used[i]`` of GPU i already reserved (a fraction, 1 = all of it)."""
    used = used or {}
    return NodeView(node_id, address, round(cpus * 1000), round((cpus - cpu_used) * 1000),
                    tuple(GpuView(i, f"GPU-{node_id}-{i}",
                                  GPU_UNITS - round(used.get(i, 0) * GPU_UNITS))
                          for i in range(gpus)))


def req(n: int, strategy: Strategy, cpu: float = 1, gpu: float = 1) -> PlacementRequest:
    return PlacementRequest((BundleSpec.from_resources({"CPU": cpu, "GPU": gpu}),) * n, strategy)


def busy(n: int) -> dict[int, float]:
    """GPUs 0..n-1 fully taken."""
    return {i: 1 for i in range(n)}


A8 = node("node-a", "10.0.0.1", gpus=8)
B8 = node("node-b", "10.0.0.2", gpus=8)
B4 = node("node-b", "10.0.0.2", gpus=4)
C4 = node("node-c", "10.0.0.3", gpus=4)
D4 = node("node-d", "10.0.0.4", gpus=4)

# (name, nodes, request, expected nodes per bundle) -- placements that succeed.
PLACED = [
    # STRICT_PACK picks the tightest node: node-b has exactly 4 idle GPUs, so node-a's 8
    # stay whole for a later group of 8.
    ("strict_pack_best_fit", [A8, B4], req(4, S.STRICT_PACK), ["node-b"] * 4),
    # node-a: 8 GPUs, 4 taken -> 4 idle = exactly the group; node-b (8 idle) is looser.
    ("strict_pack_tightest_free", [node("node-a", "10.0.0.1", used=busy(4)), B8],
     req(4, S.STRICT_PACK), ["node-a"] * 4),
    # PACK keeps a group on one node when one can hold it (the tightest).
    ("pack_one_node", [A8, B4], req(3, S.PACK), ["node-b"] * 3),
    # PACK of 12 whole GPUs: no node has 12; fill the emptiest first: 8 on node-a, 4 on node-b.
    ("pack_fills_largest_first", [B4, A8], req(12, S.PACK), ["node-a"] * 8 + ["node-b"] * 4),
    # Two equal nodes: the lower address fills first (8), the rest (2) on the other.
    ("pack_ties_by_address", [B8, A8], req(10, S.PACK), ["node-a"] * 8 + ["node-b"] * 2),
    # SPREAD of 4 over 4 nodes: one bundle each; the emptiest (8 GPUs) first, then address order.
    ("spread_distinct", [A8, B4, C4, D4], req(4, S.SPREAD),
     ["node-a", "node-b", "node-c", "node-d"]),
    # SPREAD of 4 over 2 nodes: round-robin, each node gets a second bundle in round two.
    ("spread_round_robin", [A8, B8], req(4, S.SPREAD), ["node-a", "node-b", "node-a", "node-b"]),
    # SPREAD of 3: node-c is full (4 of 4 taken), so node-a gets bundles 0 and 2.
    ("spread_reuses_when_short", [A8, B8, node("node-c", "10.0.0.3", gpus=4, used=busy(4))],
     req(3, S.SPREAD), ["node-a", "node-b", "node-a"]),
    # STRICT_SPREAD of 2 over 3 nodes; node-a is full -> node-b and node-c.
    ("strict_spread_skips_full", [node("node-a", "10.0.0.1", used=busy(8)), B4, C4],
     req(2, S.STRICT_SPREAD), ["node-b", "node-c"]),
    # STRICT_SPREAD: the 2-GPU bundle chooses first (only node-a has 2 idle: 8 - 6 taken),
    # the 1-GPU bundle takes the tightest node left, node-b (1 idle: 4 - 3 taken).
    ("strict_spread_large_first",
     [node("node-a", "10.0.0.1", used=busy(6)), node("node-b", "10.0.0.2", gpus=4, used=busy(3))],
     PlacementRequest((BundleSpec.from_resources({"GPU": 1}),
                       BundleSpec.from_resources({"GPU": 2})), S.STRICT_SPREAD),
     ["node-b", "node-a"]),
]


@pytest.mark.parametrize("name, nodes, request_, expected", PLACED, ids=[c[0] for c in PLACED])
def test_placed(name, nodes, request_, expected):
    result = place(request_, Snapshot(tuple(nodes)))
    assert isinstance(result, Placement), result
    assert list(result.node_ids()) == expected
    assert [a.bundle_index for a in result.assignments] == list(range(len(expected)))
    apply(Snapshot(tuple(nodes)), result, request_)  # it really fits


# (name, nodes, request, kind, message part, {node: reason part})
REFUSED = [
    ("no_nodes", [], req(1, S.PACK), Infeasible, "no nodes registered", {}),
    # Both nodes have 4 GPUs in all; 8 bundles of 1 GPU on one node can never fit.
    ("strict_pack_too_big", [B4, C4], req(8, S.STRICT_PACK), Infeasible, "can never be placed",
     {"node-b": "4 GPUs, bundle group needs 8 on one node (STRICT_PACK)",
      "node-c": "4 GPUs, bundle group needs 8 on one node (STRICT_PACK)"}),
    # node-a: 8 GPUs, 4 taken by pg1 -> 4 free; the STRICT_PACK of 6 fits 8 but not 4 now.
    ("strict_pack_wait", [node("node-a", "10.0.0.1", used=busy(4))], req(6, S.STRICT_PACK),
     Unavailable, "does not fit the free capacity now",
     {"node-a": "4 of 8 GPUs free, bundle group needs 6 on one node (STRICT_PACK)"}),
    # 3 bundles of CPU 4 = 12 CPUs on one node of 8 CPUs.
    ("strict_pack_cpu_sum", [node("node-a", "10.0.0.1", cpus=8)], req(3, S.STRICT_PACK, cpu=4),
     Infeasible, "STRICT_PACK",
     {"node-a": "8 CPUs, bundle group needs 12 on one node (STRICT_PACK)"}),
    # One bundle asks 16 CPUs; every node has 8.
    ("bundle_cpu_too_big", [node("node-a", "10.0.0.1", cpus=8), node("node-b", "10.0.0.2", cpus=8)],
     req(1, S.PACK, cpu=16), Infeasible, "16 CPUs",
     {"node-a": "8 CPUs, a bundle needs 16", "node-b": "8 CPUs, a bundle needs 16"}),
    # A GPU bundle on CPU-only nodes.
    ("no_gpus", [node("node-a", "10.0.0.1", gpus=0)], req(1, S.PACK), Infeasible, "",
     {"node-a": "no GPUs, a bundle needs 1 whole GPU"}),
    # A bundle of 4 whole GPUs on a node of 2.
    ("bundle_gpus_too_big", [node("node-a", "10.0.0.1", gpus=2)], req(1, S.PACK, gpu=4),
     Infeasible, "", {"node-a": "2 GPUs, a bundle needs 4 whole GPUs"}),
    # STRICT_SPREAD of 3 on 2 nodes: never 3 distinct nodes.
    ("strict_spread_too_few_nodes", [A8, B8], req(3, S.STRICT_SPREAD), Infeasible,
     "needs 3 distinct nodes, 2 can hold a bundle",
     {"node-a": "one bundle per node: 3 bundles need 3 nodes, 2 can hold one"}),
    # STRICT_SPREAD of 2 on 2 nodes, node-b full now (4 of 4 taken): wait.
    ("strict_spread_wait", [A8, node("node-b", "10.0.0.2", gpus=4, used=busy(4))],
     req(2, S.STRICT_SPREAD), Unavailable, "needs 2 distinct nodes, 1 can hold a bundle",
     {"node-b": "0 of 4 GPUs idle, a bundle needs 1 whole GPU"}),
    # PACK of 16 whole GPUs on 8 + 4 GPUs: never.
    ("pack_too_big", [A8, B4], req(16, S.PACK), Infeasible, "it needs 16 GPUs and 16 CPUs",
     {"node-a": "holds 8 of the 16 bundles (8 GPUs, 16 CPUs)",
      "node-b": "holds 4 of the 16 bundles (4 GPUs, 16 CPUs)"}),
    # SPREAD of 12 on 8 + 4 GPUs with 2 taken on node-a -> 10 idle now: wait.
    ("spread_wait", [node("node-a", "10.0.0.1", used=busy(2)), B4], req(12, S.SPREAD),
     Unavailable, "10 of 12 GPUs",
     {"node-a": "holds 6 of the 12 bundles (6 of 8 GPUs free, 16 of 16 CPUs free)"}),
    # A 0.5 GPU bundle where every GPU has only 0.25 free now.
    ("fraction_wait", [node("node-a", "10.0.0.1", gpus=2, used={0: 0.75, 1: 0.75})],
     req(1, S.PACK, gpu=0.5), Unavailable, "",
     {"node-a": "no GPU has 0.500 free (most free on one GPU: 0.250)"}),
]


@pytest.mark.parametrize("name, nodes, request_, kind, message, reasons", REFUSED,
                         ids=[c[0] for c in REFUSED])
def test_refused(name, nodes, request_, kind, message, reasons):
    result = place(request_, Snapshot(tuple(nodes)))
    assert type(result) is kind, result
    assert message in result.message
    assert set(result.node_reasons) == {n.node_id for n in nodes}
    for node_id, part in reasons.items():
        assert part in result.node_reasons[node_id], result.node_reasons


def test_whole_gpu_bundles_own_distinct_gpus_lowest_first():
    # node-a: GPU 1 is half used, so a 2-GPU bundle takes idle GPUs 0 and 2.
    snap = Snapshot.of(node("node-a", "10.0.0.1", gpus=4, used={1: 0.5}))
    result = place(PlacementRequest((BundleSpec.from_resources({"GPU": 2}),
                                     BundleSpec.from_resources({"GPU": 1})), S.STRICT_PACK), snap)
    assert [a.gpu_indices for a in result.assignments] == [(0, 2), (3,)]
    full = place(req(8, S.STRICT_PACK), Snapshot.of(A8))
    assert sorted(g for a in full.assignments for g in a.gpu_indices) == list(range(8))


@pytest.mark.parametrize("fraction, gpu", [
    (0.25, 1),   # free: GPU0 0.5, GPU1 0.25, GPU2 1 -> 0.25 fits GPU1 exactly (tightest)
    (0.5, 0),    # GPU0 (0.5 free) is tighter than the idle GPU2
    (0.6, 2),    # only the idle GPU2 has 0.6 free
])
def test_fractional_bundle_takes_the_tightest_gpu(fraction, gpu):
    snap = Snapshot.of(node("node-a", "10.0.0.1", gpus=3, used={0: 0.5, 1: 0.75}))
    result = place(req(1, S.PACK, gpu=fraction), snap)
    assert result.assignments[0].gpu_indices == (gpu,)


def test_fractional_ties_go_to_the_lowest_index():
    # GPUs 1 and 3 both have 0.5 free -> GPU 1.
    snap = Snapshot.of(node("node-a", "10.0.0.1", gpus=4, used={0: 1, 1: 0.5, 2: 1, 3: 0.5}))
    assert place(req(1, S.PACK, gpu=0.5), snap).assignments[0].gpu_indices == (1,)


def test_thirds_share_a_gpu_and_a_fourth_opens_the_next():
    # 3 x 1/3 fill GPU 0 exactly; the fourth goes to GPU 1.
    snap = Snapshot.of(node("node-a", "10.0.0.1", gpus=2))
    result = place(req(4, S.STRICT_PACK, gpu=1 / 3), snap)
    assert [a.gpu_indices for a in result.assignments] == [(0,), (0,), (0,), (1,)]
    # 4 x 1/3 on a single GPU: 4/3 > 1 can never fit.
    one = Snapshot.of(node("node-a", "10.0.0.1", gpus=1))
    assert isinstance(place(req(4, S.STRICT_PACK, gpu=1 / 3), one), Infeasible)


def test_fractions_are_packed_largest_first():
    # 0.25 + 0.75 share one GPU exactly.
    snap = Snapshot.of(node("node-a", "10.0.0.1", gpus=1))
    bundles = tuple(BundleSpec.from_resources({"GPU": g}) for g in (0.25, 0.75))
    result = place(PlacementRequest(bundles, S.STRICT_PACK), snap)
    assert [a.gpu_indices for a in result.assignments] == [(0,), (0,)]
    # 0.3, 0.3, 0.7, 0.7 on 2 GPUs. In bundle order best fit would stack both 0.3 on
    # GPU 0 (0.4 left) and find no room for the second 0.7; largest first gives
    # 0.7 + 0.3 on each GPU.
    snap2 = Snapshot.of(node("node-a", "10.0.0.1", gpus=2))
    bundles = tuple(BundleSpec.from_resources({"GPU": g}) for g in (0.3, 0.3, 0.7, 0.7))
    result = place(PlacementRequest(bundles, S.STRICT_PACK), snap2)
    assert isinstance(result, Placement)
    per_gpu = Counter()
    for a, b in zip(result.assignments, bundles):
        per_gpu[a.gpu_indices[0]] += b.gpu_units
    assert set(per_gpu.values()) == {GPU_UNITS}


def test_fractions_prefer_a_partly_used_gpu_on_another_node():
    # node-a is idle; node-b has a GPU with 0.5 free: a 0.5 bundle fills node-b's GPU
    # instead of breaking one of node-a's idle GPUs.
    snap = Snapshot.of(A8, node("node-b", "10.0.0.2", gpus=2, used={0: 0.5}))
    result = place(req(1, S.STRICT_PACK, gpu=0.5), snap)
    assert result.assignments[0].node_id == "node-b"
    assert result.assignments[0].gpu_indices == (0,)


@pytest.mark.parametrize("order", [(8, 4), (4, 8)])
def test_heterogeneous_pools_place_in_either_order(order):
    # verl's ResourcePool([8, 4]): one STRICT_PACK group per entry, on an 8-GPU and a
    # 4-GPU node. Best fit sends the 4 to the 4-GPU node whichever comes first.
    snap = Snapshot.of(node("big", "10.0.0.1", gpus=8), node("small", "10.0.0.2", gpus=4))
    where = {}
    for n in order:
        request_ = req(n, S.STRICT_PACK)
        result = place(request_, snap)
        assert isinstance(result, Placement), result
        where[n] = set(result.node_ids())
        snap = apply(snap, result, request_)
    assert where == {8: {"big"}, 4: {"small"}}


def test_cpu_only_bundles():
    # CPU-only nodes of 8 and 32 CPUs: a 4-CPU STRICT_PACK group of 2 (8 CPUs) fits the
    # 8-CPU node exactly (best fit), owns no GPU.
    snap = Snapshot.of(node("big", "10.0.0.1", gpus=0, cpus=32), node("small", "10.0.0.2", gpus=0, cpus=8))
    request_ = PlacementRequest((BundleSpec.from_resources({"CPU": 4}),) * 2, S.STRICT_PACK)
    result = place(request_, snap)
    assert result.node_ids() == ("small", "small")
    assert all(a.gpu_indices == () for a in result.assignments)
    # SPREAD of CPU-only bundles goes to the node with the most free CPU first.
    spread = place(PlacementRequest(request_.bundles, S.SPREAD), snap)
    assert spread.node_ids() == ("big", "small")
    # CPU-only bundles also fit next to GPUs on GPU nodes.
    assert isinstance(place(request_, Snapshot.of(A8)), Placement)


def test_mixed_group_of_gpu_and_cpu_bundles():
    bundles = (BundleSpec.from_resources({"CPU": 2, "GPU": 1}), BundleSpec.from_resources({"CPU": 4}))
    result = place(PlacementRequest(bundles, S.STRICT_PACK), Snapshot.of(B4))
    assert [a.gpu_indices for a in result.assignments] == [(0,), ()]


def test_ties_follow_numeric_address_order():
    # verl sorts addresses as strings ("10.0.0.10" < "10.0.0.9"); Podium numerically.
    nine = node("z-node", "10.0.0.9")
    ten = node("a-node", "10.0.0.10")
    snap = Snapshot.of(ten, nine)
    assert place(req(1, S.STRICT_PACK), snap).node_ids() == ("z-node",)
    assert place(req(2, S.SPREAD), snap).node_ids() == ("z-node", "a-node")
    assert place(req(2, S.STRICT_SPREAD), snap).node_ids() == ("z-node", "a-node")
    # Equal addresses fall back to the node id.
    twins = Snapshot.of(node("n2", "10.0.0.1"), node("n1", "10.0.0.1"))
    assert place(req(1, S.STRICT_PACK), twins).node_ids() == ("n1",)


@pytest.mark.parametrize("strategy", list(Strategy))
def test_result_does_not_depend_on_node_order(strategy):
    nodes = [node("node-a", "10.0.0.1", used={0: 0.5, 3: 1}),
             node("node-b", "10.0.0.2", gpus=4, used={1: 1}),
             node("node-c", "10.0.0.10", gpus=4),
             node("node-d", "host-d", gpus=8, used=busy(5))]
    request_ = PlacementRequest((BundleSpec.from_resources({"CPU": 1, "GPU": 1}),) * 3
                                + (BundleSpec.from_resources({"CPU": 1, "GPU": 0.5}),), strategy)
    results = {place(request_, Snapshot(perm)) for perm in itertools.permutations(nodes)}
    assert len(results) == 1


def test_strict_pack_group_is_atomic():
    # 6 bundles, best node has 4 idle: nothing is placed (no partial Placement).
    snap = Snapshot.of(node("node-a", "10.0.0.1", gpus=4), node("node-b", "10.0.0.2", gpus=4))
    assert isinstance(place(req(6, S.STRICT_PACK), snap), Infeasible)
    assert isinstance(place(req(6, S.PACK), snap), Placement)


def test_infeasible_lists_every_node_with_numbers():
    nodes = [node(f"node-{i}", f"10.0.0.{i}", gpus=4) for i in range(1, 4)]
    result = place(req(5, S.STRICT_PACK), Snapshot(tuple(nodes)))
    assert isinstance(result, Infeasible)
    assert result.node_reasons == {
        n.node_id: "4 GPUs, bundle group needs 5 on one node (STRICT_PACK)" for n in nodes}
    assert "5 x {CPU: 1, GPU: 1}" in result.message and "12 GPUs" in result.message


def test_request_accepts_user_forms_and_validates():
    request = PlacementRequest([{"CPU": 1, "GPU": 1}] * 2, "strict_pack")
    assert request == req(2, S.STRICT_PACK)
    with pytest.raises(ValueError, match="at least one bundle"):
        PlacementRequest((), S.PACK)
    # A custom resource is a bundle of its own (test_core_custom.py); a bad name is refused.
    assert PlacementRequest([{"TPU": 1}], S.PACK).bundles[0].custom == (("TPU", 10000),)
    with pytest.raises(ValueError, match="bundle 0: .*'T PU'"):
        PlacementRequest([{"T PU": 1}], S.PACK)
    with pytest.raises(ValueError, match="unknown placement strategy"):
        PlacementRequest([{"GPU": 1}], 0)
