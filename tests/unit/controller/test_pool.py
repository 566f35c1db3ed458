"""Resource pool arithmetic, rank order, split/merge and the per-node fit check (no sockets)."""

from __future__ import annotations

import pytest

from podium.controller.pool import (ResourcePool, SubRayResourcePool, check_pools_fit, merge_resource_pool,
                                    split_resource_pool)
from podium.errors import InfeasibleError
from podium.v1 import common_pb2, scheduler_pb2


def fake_pg(pg_id: str, address: str, n: int, node_id: str | None = None, gpu_start: int = 0):
    pg = common_pb2.PlacementGroup(id=pg_id, name=pg_id, state=common_pb2.PG_CREATED)
    for b in range(n):
        pg.bundles.add().resources.update({"CPU": 1.0, "GPU": 1.0})
        pg.placements.add(bundle_index=b, node_id=node_id or address, node_address=address,
                          gpu_indices=[gpu_start + b])
    return pg


@pytest.mark.parametrize("store,lws,lrs", [
    ([2, 3], [2, 2, 3, 3, 3], [0, 1, 0, 1, 2]),
    ([4], [4] * 4, [0, 1, 2, 3]),
    ([2, 4], [2, 2, 4, 4, 4, 4], [0, 1, 0, 1, 2, 3]),
])
def test_local_lists(store, lws, lrs):
    pool = ResourcePool(process_on_nodes=store)
    assert pool.world_size == sum(store) and pool() == store and pool.store == store
    assert pool.local_world_size_list() == lws
    assert pool.local_rank_list() == lrs


def test_bundles_and_names():
    assert ResourcePool([2], max_colocate_count=3).bundle() == {"CPU": 3.0, "GPU": 1.0}
    assert ResourcePool([2], use_gpu=False, max_colocate_count=2).bundle() == {"CPU": 2.0}
    pool = ResourcePool([2, 2], name_prefix="envp")
    assert pool.pg_name(0) == "envpverl_group_2_2:0"
    assert len(ResourcePool([1]).name_prefix) == 6
    pool.add_node(3)
    assert pool.store == [2, 2, 3]


@pytest.mark.parametrize("bad", [[0], [-1], [1.5]])
def test_bad_process_counts(bad):
    with pytest.raises(ValueError):
        ResourcePool(process_on_nodes=bad)


def test_slots_follow_node_address_order_numerically():
    pool = ResourcePool([2, 4])
    # the 2-bundle group landed on .10, the 4-bundle one on .9: .9 comes first numerically
    pool.pgs = [fake_pg("pg-a", "10.0.0.10", 2), fake_pg("pg-b", "10.0.0.9", 4)]
    addresses = [pg.placements[b].node_address for pg, b in pool.slots()]
    assert addresses == ["10.0.0.9"] * 4 + ["10.0.0.10"] * 2
    assert pool.local_world_size_list() == [2, 2, 4, 4, 4, 4]  # follows the groups' own sizes
    assert [(pg_idx, b) for _, pg_idx, b in pool.worker_slots()] == [(1, 0), (1, 1), (1, 2), (1, 3), (0, 0), (0, 1)]


def test_split_by_int_and_list():
    pool = ResourcePool([4, 4], name_prefix="p")
    pool.pgs = [fake_pg("pg0", "127.0.0.2", 4), fake_pg("pg1", "127.0.0.3", 4)]
    subs = split_resource_pool(pool, 2)
    assert [s.world_size for s in subs] == [2, 2, 2, 2]
    assert [s.start_bundle_index for s in subs] == [0, 2, 4, 6]
    assert [s.name_prefix for s in subs] == ["p_split_0", "p_split_1", "p_split_2", "p_split_3"]
    assert all(s.store == [4, 4] for s in subs)
    assert [(pg.id, b) for pg, b in subs[2].slots()] == [("pg1", 0), ("pg1", 1)]
    across = split_resource_pool(pool, [3, 5])
    assert [s.node_counts() for s in across] == [[3], [1, 4]]
    assert across[1].local_world_size_list() == [1, 4, 4, 4, 4]
    # splitting a split pool offsets by the parent's start
    twice = split_resource_pool(across[1], [1, 4])
    assert [s.start_bundle_index for s in twice] == [3, 4]
    assert [(pg.id, b) for pg, b in twice[0].slots()] == [("pg0", 3)]
    with pytest.raises(AssertionError):
        split_resource_pool(pool, 3)
    with pytest.raises(AssertionError):
        split_resource_pool(pool, [3, 3])
    assert isinstance(subs[0], SubRayResourcePool)


def test_merge():
    rm = ResourcePool([4], name_prefix="rm")
    ref = ResourcePool([4], name_prefix="ref")
    rm.pgs = [fake_pg("pg-rm", "127.0.0.1", 4)]
    ref.pgs = [fake_pg("pg-ref", "127.0.0.1", 4, gpu_start=4)]
    merged = merge_resource_pool(rm, ref)
    assert merged.world_size == 8 and merged.store == [4, 4] and merged.name_prefix == "rm_ref"
    assert [pg.id for pg in merged.pgs] == ["pg-rm", "pg-ref"]
    gpus = [pg.placements[b].gpu_indices[0] for pg, b in merged.slots()]
    assert gpus == list(range(8))
    with pytest.raises(AssertionError, match="max_colocate_count"):
        merge_resource_pool(rm, ResourcePool([4], max_colocate_count=3))


def cluster_of(*nodes):
    state = scheduler_pb2.ClusterState()
    for node_id, address, gpus in nodes:
        status = state.nodes.add(state=common_pb2.NODE_ALIVE)
        status.info.node_id, status.info.address, status.info.cpus = node_id, address, 64
        for i in range(gpus):
            status.info.gpus.add(index=i, uuid=f"GPU-{node_id}-{i}")
    return state


def test_fit_check_is_per_node_not_total():
    # 8 GPUs in total, but an 8-process entry needs one node with 8: verl's total check passes
    state = cluster_of(("node-a", "127.0.0.2", 4), ("node-b", "127.0.0.3", 4))
    with pytest.raises(InfeasibleError) as info:
        check_pools_fit([("global_pool", ResourcePool([8], max_colocate_count=3))], state)
    assert "global_pool" in str(info.value)
    assert set(info.value.node_reasons) == {"node-a", "node-b"}
    check_pools_fit([("global_pool", ResourcePool([4, 4], max_colocate_count=3))], state)


def test_fit_check_counts_pools_together_and_existing_groups():
    state = cluster_of(("node-a", "127.0.0.2", 8))
    check_pools_fit([("a", ResourcePool([6], max_colocate_count=3)), ("b", ResourcePool([2], max_colocate_count=3))], state)
    with pytest.raises(InfeasibleError):
        check_pools_fit([("a", ResourcePool([6], max_colocate_count=3)), ("b", ResourcePool([3], max_colocate_count=3))], state)
    # a group already holding 4 GPUs leaves 4
    state.placement_groups.append(fake_pg("pg-x", "127.0.0.2", 4, node_id="node-a"))
    with pytest.raises(InfeasibleError):
        check_pools_fit([("a", ResourcePool([6], max_colocate_count=3))], state)
    check_pools_fit([("a", ResourcePool([4], max_colocate_count=3))], state)
