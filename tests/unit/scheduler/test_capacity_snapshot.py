"""The capacity snapshot the model keeps up to date equals the one rebuilt from its records,
through any sequence of placements, removals, node deaths and re-registrations; the
chunked /v1/placement JSON equals the plain view."""

import asyncio
import json
import random

import pytest

from podium import errors
from podium.scheduler import http
from podium.scheduler.state import ClusterModel
from podium.v1 import common_pb2

STRATEGIES = [common_pb2.PACK, common_pb2.SPREAD, common_pb2.STRICT_PACK, common_pb2.STRICT_SPREAD]
SHAPES = [[{"CPU": 1, "GPU": 1}] * 8, [{"CPU": 1, "GPU": 1}] * 4, [{"CPU": 1, "GPU": 1 / 3}] * 3,
          [{"CPU": 2, "GPU": 0.5}] * 2, [{"CPU": 4}] * 2, [{"CPU": 1, "GPU": 2}] * 3]


def _node(n: int, gpus: int) -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(
        node_id=f"node-{n}", address=f"10.0.0.{n}", agent_port=7000 + n, cpus=32,
        gpus=[common_pb2.GpuInfo(index=i, uuid=f"GPU-{n}-{i}") for i in range(gpus)])


def _by_node(snapshot):
    return sorted(snapshot.nodes, key=lambda v: v.node_id)


def _check(model: ClusterModel) -> None:
    kept = model.snapshot()
    assert _by_node(kept) == _by_node(model.groups.build_snapshot())
    # Every GPU once per alive node, never over-reserved.
    for view in kept.nodes:
        assert len({g.index for g in view.gpus}) == len(view.gpus)
        assert all(0 <= g.free_units <= g.total_units for g in view.gpus)
        assert 0 <= view.free_cpu_units <= view.total_cpu_units


@pytest.mark.parametrize("seed", range(6))
def test_kept_snapshot_equals_the_rebuilt_one(seed):
    rng = random.Random(seed)
    model = ClusterModel(node_lease=10)
    nodes = list(range(2, 14))
    for n in nodes:
        model.register_node(_node(n, 8), [], now=0)
    live: list[str] = []
    now = 1.0
    for step in range(300):
        now += 0.01
        op = rng.random()
        if op < 0.5:
            try:
                group = model.create_placement_group(f"g{step}", rng.choice(SHAPES), rng.choice(STRATEGIES),
                                                     True, "", now)
            except errors.InfeasibleError:
                continue
            live.append(group.id)
        elif op < 0.8 and live:
            model.remove_placement_group(live.pop(rng.randrange(len(live))), now)
        elif op < 0.86:
            # A node dies (its lease runs out): its groups go, the snapshot loses it.
            victim = rng.choice(nodes)
            node = model.nodes[f"node-{victim}"]
            if node.state == common_pb2.NODE_ALIVE:
                model.node_died(node, now)
        elif op < 0.93:
            # A node (re-)registers, sometimes with fewer or more GPUs than before.
            model.register_node(_node(rng.choice(nodes), rng.choice([4, 8, 8])), [], now=now)
        else:
            # A re-registration with the same capacity keeps the snapshot object.
            alive = [n for n in model.nodes.values() if n.state == common_pb2.NODE_ALIVE]
            if alive:
                node = rng.choice(alive)
                before = model.snapshot()
                model.register_node(node.info, [], now=now)
                if not any(g.state == common_pb2.PG_PENDING for g in model.groups.values()):
                    assert model.snapshot() is before
        _check(model)


def test_live_names_follow_creation_and_removal():
    model = ClusterModel()
    model.register_node(_node(2, 8), [], now=0)
    first = model.create_placement_group("pool", [{"GPU": 1}], common_pb2.PACK, True, "", 1.0)
    with pytest.raises(errors.AlreadyExistsError):
        model.create_placement_group("pool", [{"GPU": 1}], common_pb2.PACK, True, "", 1.0)
    model.remove_placement_group(first.id, 2.0)
    assert model.group(name="pool") is first  # a removed group is still found by name
    second = model.create_placement_group("pool", [{"GPU": 1}], common_pb2.PACK, True, "", 3.0)
    assert model.group(name="pool") is second


def test_chunked_placement_json_equals_the_view():
    model = ClusterModel()
    for n in range(2, 9):
        model.register_node(_node(n, 8), [], now=0)
    for i, shape in enumerate(SHAPES * 2):
        model.create_placement_group(f"g{i}", shape, common_pb2.PACK, True, "", 1.0)
    body = asyncio.run(http.placement_json(model, "sched-1", chunk=3))
    assert json.loads(body) == http.placement_view(model, "sched-1")
    assert len(json.loads(body)["nodes"]) == 7


def test_kept_group_entries_follow_every_change():
    # The page made with the groups' kept entries equals the one made from scratch after each
    # change to a group's record, and the kept entries are only the live groups'.
    model = ClusterModel()
    for n in range(2, 6):
        model.register_node(_node(n, 8), [], now=0)
    kept: dict = {}
    ids = [model.create_placement_group(f"g{i}", shape, common_pb2.PACK, True, "", 1.0).id
           for i, shape in enumerate(SHAPES)]

    def same_page():
        body = asyncio.run(http.placement_json(model, "s", chunk=2, kept=kept))
        assert json.loads(body) == http.placement_view(model, "s")
        assert set(kept) == {g.id for g in model.groups.values() if g.state != common_pb2.PG_REMOVED}

    same_page()
    model.remove_placement_group(ids[0], 2.0)  # its GPUs are free on the next page
    same_page()
    # A group that waits for capacity is PENDING, then CREATED once others go.
    bigs = [model.create_placement_group(f"big{i}", [{"CPU": 1, "GPU": 1}] * 8, common_pb2.STRICT_PACK,
                                         True, "", 3.0) for i in range(4)]
    waiting = bigs[-1]
    assert waiting.state == common_pb2.PG_PENDING
    same_page()
    for group_id in ids[1:]:
        model.remove_placement_group(group_id, 4.0)
    assert waiting.state == common_pb2.PG_CREATED
    same_page()
    model.node_died(model.nodes["node-2"], 5.0)  # its groups are removed with it
    same_page()


def test_chunked_nodes_and_workers_json_equal_their_views():
    # /v1/nodes and /v1/workers are rendered RECORD_CHUNK records at a time: with several
    # chunks the page is still the whole view, secrets still redacted.
    model = ClusterModel()
    for n in range(2, 2 + 2 * http.RECORD_CHUNK + 7):
        model.register_node(_node(n, 2), [], now=0)
    group = model.create_placement_group("g", [{"CPU": 1, "GPU": 1}] * 2, common_pb2.PACK, True, "", 1.0)
    specs = [common_pb2.WorkerSpec(name=f"w{r}", group="g", rank=r, world_size=2, num_gpus=1, num_cpus=1,
                                   placement_group_id=group.id, bundle_index=r,
                                   env={"WANDB_API_KEY": "secret", "SEED": "1"}) for r in range(2)]
    model.create_workers(specs, "", 0, 29500, 2.0)
    nodes = json.loads(asyncio.run(http._chunked_json("nodes", http._sorted_nodes(model), http._dict)))
    assert nodes == http.nodes_view(model) and len(nodes["nodes"]) == 2 * http.RECORD_CHUNK + 7
    workers = json.loads(asyncio.run(http._chunked_json("workers", list(model.workers.values()),
                                                        http._worker_dict)))
    assert workers == http.workers_view(model) and len(workers["workers"]) == 2
    assert all(w["spec"]["env"]["WANDB_API_KEY"] == http.REDACTED for w in workers["workers"])
