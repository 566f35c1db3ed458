"""ClusterModel without sockets: groups, slots, leases, env, and bad input that changes nothing."""

import math

import pytest

from podium import errors
from podium.scheduler.state import ClusterModel
from podium.v1 import common_pb2, scheduler_pb2

ONE_GPU = {"CPU": 1, "GPU": 1}


def _node(n: int, gpus: int = 4, cpus: float = 16) -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(
        node_id=f"node-{n}", address=f"10.0.0.{n}", agent_port=7000 + n, cpus=cpus,
        gpus=[common_pb2.GpuInfo(index=i, uuid=f"GPU-{n}-{i}") for i in range(gpus)])


def _model(nodes=(2, 3), gpus=4, **kw) -> ClusterModel:
    model = ClusterModel(node_lease=10, default_session_lease=30, **kw)
    for n in nodes:
        model.register_node(_node(n, gpus), [], now=0)
    return model


def _spec(pg_id, rank=0, bundle=0, world=1, name=None, group="wg", num_gpus=1.0, num_cpus=1.0, **kw):
    return common_pb2.WorkerSpec(name=name or f"{group}_{rank}", group=group,
                                 placement_group_id=pg_id, bundle_index=bundle, num_gpus=num_gpus,
                                 num_cpus=num_cpus, rank=rank, world_size=world, **kw)


def _state(model: ClusterModel) -> tuple:
    """Everything observable, serialized, to prove a failed call changed nothing."""
    return (tuple(n.SerializeToString(deterministic=True) for n in model.nodes.values()),
            tuple(g.SerializeToString(deterministic=True) for g in model.groups.values()),
            tuple(w.SerializeToString(deterministic=True) for w in model.workers.values()),
            tuple(sorted(model.sessions)))


# ------------------------------------------------------------------ placement groups

def test_created_pending_then_promoted_when_a_group_is_removed():
    model = _model()
    a = model.create_placement_group("a", [ONE_GPU] * 4, 3, False, "", now=1)
    b = model.create_placement_group("b", [ONE_GPU] * 4, 3, False, "", now=2)
    c = model.create_placement_group("c", [ONE_GPU] * 4, 3, False, "", now=3)
    assert (a.state, b.state, c.state) == (common_pb2.PG_CREATED, common_pb2.PG_CREATED,
                                           common_pb2.PG_PENDING)
    assert "node-2" in c.reason and "node-3" in c.reason
    assert {p.node_id for p in a.placements} != {p.node_id for p in b.placements}
    model.remove_placement_group(a.id, now=4)
    assert c.state == common_pb2.PG_CREATED and c.reason == ""
    assert {p.node_id for p in c.placements} == {p.node_id for p in a.placements}


def test_pending_groups_are_retried_in_creation_order_when_a_node_registers():
    model = _model(nodes=())
    first = model.create_placement_group("first", [ONE_GPU] * 3, 3, False, "", now=1)
    second = model.create_placement_group("second", [ONE_GPU] * 3, 3, False, "", now=2)
    assert first.state == second.state == common_pb2.PG_PENDING
    assert first.reason == "no alive nodes"
    model.register_node(_node(2, gpus=4), [], now=3)
    assert first.state == common_pb2.PG_CREATED and second.state == common_pb2.PG_PENDING


def test_spread_uses_both_nodes_and_strict_pack_one():
    model = _model()
    spread = model.create_placement_group("s", [ONE_GPU] * 2, 2, False, "", now=1)
    pack = model.create_placement_group("p", [ONE_GPU] * 2, 3, False, "", now=1)
    assert len({p.node_id for p in spread.placements}) == 2
    assert len({p.node_id for p in pack.placements}) == 1
    assert [p.gpu_uuids[0] for p in pack.placements] == [
        f"GPU-{p.node_id[-1]}-{p.gpu_indices[0]}" for p in pack.placements]


def test_infeasible_at_once_with_per_node_reasons_and_nothing_stored():
    model = _model()
    before = _state(model)
    with pytest.raises(errors.InfeasibleError) as info:
        model.create_placement_group("big", [{"GPU": 1}] * 5, 3, False, "", now=1)
    assert set(info.value.node_reasons) == {"node-2", "node-3"}
    assert _state(model) == before


NAN = math.nan
BAD_GROUPS = [
    # (name, bundles, strategy, error class, text the message must contain)
    ("", [ONE_GPU], 1, errors.InvalidArgumentError, "name"),
    ("g", [], 1, errors.InvalidSpecError, "at least one bundle"),
    ("g", [{"GPU": -1}], 1, errors.InvalidSpecError, "-1"),
    ("g", [{"CPU": NAN}], 1, errors.InvalidSpecError, "nan"),
    ("g", [{"GPU": 1.5}], 1, errors.InvalidSpecError, "1.5"),
    ("g", [{"T PU": 1}], 1, errors.InvalidSpecError, "T PU"),
    ("g", [{}], 1, errors.InvalidSpecError, "empty"),
    ("g", [ONE_GPU], 0, errors.InvalidSpecError, "strategy"),
    ("g", [ONE_GPU], 9, errors.InvalidSpecError, "9"),
    ("taken", [ONE_GPU], 1, errors.AlreadyExistsError, "taken"),
]


@pytest.mark.parametrize("name,bundles,strategy,cls,text", BAD_GROUPS)
def test_bad_group_requests_raise_and_change_nothing(name, bundles, strategy, cls, text):
    model = _model()
    model.create_placement_group("taken", [ONE_GPU], 1, False, "", now=0)
    before = _state(model)
    with pytest.raises(cls, match=text) as info:
        model.create_placement_group(name, bundles, strategy, False, "", now=1)
    assert type(info.value) is cls
    assert _state(model) == before


@pytest.mark.parametrize("call,cls", [
    (lambda m: m.group("pg-nope"), errors.NotFoundError),
    (lambda m: m.group(name="nope"), errors.NotFoundError),
    (lambda m: m.group(), errors.InvalidArgumentError),
    (lambda m: m.remove_placement_group("pg-nope", 1), errors.NotFoundError),
    (lambda m: m.worker("w-nope"), errors.NotFoundError),
    (lambda m: m.get_workers(names=["nope"]), errors.NotFoundError),
    (lambda m: m.remove_workers(["w-nope"], 1), errors.NotFoundError),
    (lambda m: m.close_session("s-nope", 1), errors.NotFoundError),
    (lambda m: m.create_placement_group("x", [ONE_GPU], 1, False, "s-nope", 1), errors.NotFoundError),
    (lambda m: m.open_session("", -1, 1), errors.InvalidArgumentError),
    (lambda m: m.report_worker(scheduler_pb2.ReportWorkerRequest(worker_id="w-nope"), 1),
     errors.NotFoundError),
])
def test_unknown_ids_and_bad_arguments(call, cls):
    model = _model()
    before = _state(model)
    with pytest.raises(cls):
        call(model)
    assert _state(model) == before


# ------------------------------------------------------------------ workers

def test_slot_reservation_is_all_or_nothing():
    model = _model()
    pg = model.create_placement_group("p", [{"CPU": 2, "GPU": 1}] * 2, 3, False, "", now=0)
    model.create_workers([_spec(pg.id, 0, bundle=0, world=3, num_gpus=0.5)], "", 0, 29500, now=1)
    before = _state(model)
    # Rank 1 fits bundle 1; rank 2 asks 0.75 of bundle 0 where 0.5 is left: neither is created.
    specs = [_spec(pg.id, 1, bundle=1, world=3, group="wg2"),
             _spec(pg.id, 2, bundle=0, world=3, group="wg2", num_gpus=0.75)]
    with pytest.raises(errors.SlotFullError, match="bundle 0"):
        model.create_workers(specs, "", 1, 29500, now=2)
    assert _state(model) == before


def test_many_bundles_each_worker_lands_on_its_bundles_node_and_full_bundles_are_named():
    # CreateWorkers looks placements and bundle usage up per group once (not per spec): each
    # worker still gets its own bundle's node, and the usage of the group's other workers
    # (a colocated group, bundles given in reverse order) is counted bundle by bundle.
    model = ClusterModel(node_lease=10, default_session_lease=30)
    for node in (2, 3):
        model.register_node(_node(node, gpus=0, cpus=32), [], now=0)
    n = 40
    pg = model.create_placement_group("p", [{"CPU": 1}] * n, "SPREAD", False, "", now=0)
    node_of = {p.bundle_index: p.node_id for p in pg.placements}
    assert len(set(node_of.values())) == 2
    first = model.create_workers([_spec(pg.id, r, bundle=r, world=n, num_gpus=0, num_cpus=0.5)
                                  for r in reversed(range(n))], "", 0, 29500, now=1)
    assert {w.spec.bundle_index: w.node_id for w in first} == node_of
    before = _state(model)
    # Every bundle has 0.5 CPU left: 0.5 fits everywhere, but bundle 17 is asked 0.75.
    specs = [_spec(pg.id, r, bundle=r, world=n, group="wg2", num_gpus=0,
                   num_cpus=0.75 if r == 17 else 0.5) for r in range(n)]
    with pytest.raises(errors.SlotFullError, match="bundle 17 "):
        model.create_workers(specs, "", 0, 29501, now=2)
    assert _state(model) == before
    specs[17].num_cpus = 0.5
    second = model.create_workers(specs, "", 0, 29501, now=3)
    assert [w.node_id for w in second] == [node_of[r] for r in range(n)]


def test_exited_worker_frees_its_slot():
    model = _model()
    pg = model.create_placement_group("p", [ONE_GPU], 1, False, "", now=0)
    [w] = model.create_workers([_spec(pg.id)], "", 0, 29500, now=1)
    with pytest.raises(errors.SlotFullError):
        model.create_workers([_spec(pg.id, group="b")], "", 0, 29500, now=2)
    model.report_worker(scheduler_pb2.ReportWorkerRequest(
        worker_id=w.id, state=common_pb2.WORKER_EXITED, exit=common_pb2.ExitInfo(exit_code=1)), now=3)
    model.create_workers([_spec(pg.id, group="b")], "", 0, 29500, now=4)


BAD_SPECS = [
    # (spec overrides, error class, text)
    (dict(num_gpus=1.5), errors.InvalidSpecError, "1.5"),
    (dict(num_gpus=-0.5), errors.InvalidSpecError, "-0.5"),
    (dict(num_gpus=NAN), errors.InvalidSpecError, "nan"),
    (dict(num_cpus=-1), errors.InvalidSpecError, "num_cpus"),
    (dict(rank=2, world=2), errors.InvalidArgumentError, "rank = 2"),
    (dict(world=0), errors.InvalidArgumentError, "world_size = 0"),
    (dict(bundle=7), errors.InvalidArgumentError, "bundle_index = 7"),
    (dict(pg_id="pg-nope"), errors.NotFoundError, "pg-nope"),
    (dict(pg_id="pending"), errors.FailedPreconditionError, "PENDING"),
    (dict(env={"RANK": "3"}), errors.InvalidSpecError, "RANK"),
    (dict(name="taken_0"), errors.AlreadyExistsError, "taken_0"),
    (dict(group=""), errors.InvalidArgumentError, "group"),
    (dict(master_rank=5), errors.InvalidArgumentError, "master_rank = 5"),
    (dict(owner="s-nope"), errors.NotFoundError, "s-nope"),
]


@pytest.mark.parametrize("over,cls,text", BAD_SPECS)
def test_bad_worker_specs_raise_and_change_nothing(over, cls, text):
    model = _model()
    model.create_placement_group("blocker", [ONE_GPU] * 4, 3, False, "", now=0)
    pg = model.create_placement_group("p", [ONE_GPU] * 2, 1, False, "", now=0)
    pending = model.create_placement_group("q", [ONE_GPU] * 4, 3, False, "", now=0)
    assert pending.state == common_pb2.PG_PENDING
    model.create_workers([_spec(pg.id, name="taken_0", group="taken")], "", 0, 29500, now=0)
    over = dict(over)
    pg_id = {"pending": pending.id}.get(over.get("pg_id"), over.pop("pg_id", pg.id))
    over.pop("pg_id", None)
    master_rank = over.pop("master_rank", 0)
    owner = over.pop("owner", "")
    spec = _spec(pg_id, **{"bundle": 1, **over})
    before = _state(model)
    with pytest.raises(cls, match=text) as info:
        model.create_workers([spec], owner, master_rank, 29500, now=1)
    assert type(info.value) is cls
    assert _state(model) == before


def test_environment_of_each_worker():
    model = _model()
    pg = model.create_placement_group("p", [{"CPU": 2, "GPU": 1}] * 4, 2, False, "", now=0)
    specs = [_spec(pg.id, r, bundle=r, world=4, group="actor", num_gpus=0.5, env={"X": "y"})
             for r in range(4)]
    workers = model.create_workers(specs, "", 0, 29511, now=1)
    master = workers[0]
    per_node = {}
    for w in workers:
        per_node[w.node_id] = per_node.get(w.node_id, 0) + 1
    for w, placed in zip(workers, [pg.placements[r] for r in range(4)]):
        assert w.node_id == placed.node_id
        assert w.env["MASTER_ADDR"] == master.node_address and w.env["MASTER_PORT"] == "29511"
        assert w.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, placed.gpu_indices))
        assert w.env["RANK"] == str(w.spec.rank) and w.env["WORLD_SIZE"] == "4"
        assert w.env["WG_PREFIX"] == "actor" and w.env["X"] == "y"
        assert w.env["PODIUM_WORKER_ID"] == w.id
        assert w.env["PODIUM_LOCAL_WORLD_SIZE"] == str(per_node[w.node_id])
        assert w.env["LOCAL_RANK"] == "0"
        assert w.env["OMP_NUM_THREADS"] == "1"  # as Ray: as many threads as CPUs (1 here)
    # A CPU-only worker sees no GPU.
    [cpu] = model.create_workers([_spec(pg.id, 0, bundle=0, group="cpu", num_gpus=0)], "", 0, 1, now=2)
    assert cpu.env["CUDA_VISIBLE_DEVICES"] == "" and not cpu.gpu_indices
    # The caller's env may choose the thread count.
    [mine] = model.create_workers([_spec(pg.id, 0, bundle=1, group="omp", num_gpus=0,
                                         env={"OMP_NUM_THREADS": "3"})], "", 0, 1, now=3)
    assert mine.env["OMP_NUM_THREADS"] == "3"


# ------------------------------------------------------------------ leases

def test_node_expiry_kills_its_workers_and_removes_its_groups():
    model = _model()
    spread = model.create_placement_group("s", [ONE_GPU] * 2, 4, False, "", now=0)
    other = model.create_placement_group("o", [ONE_GPU], 1, False, "", now=0)
    workers = model.create_workers([_spec(spread.id, r, bundle=r, world=2) for r in range(2)],
                                   "", 0, 29500, now=0)
    model.heartbeat("node-3", [], [], [], now=8)
    effects = model.expire(now=11)           # node-2 silent for 11 s > 10 s lease
    assert model.nodes["node-2"].state == common_pb2.NODE_DEAD
    assert model.nodes["node-3"].state == common_pb2.NODE_ALIVE
    assert spread.state == common_pb2.PG_REMOVED and spread.reason == "node node-2 died"
    dead = next(w for w in workers if w.node_id == "node-2")
    alive = next(w for w in workers if w.node_id == "node-3")
    assert dead.state == common_pb2.WORKER_EXITED and dead.exit.reason == "node node-2 died"
    assert effects.stop == {"node-3": [alive.id]}
    assert other.state == (common_pb2.PG_CREATED if other.placements[0].node_id == "node-3"
                           else common_pb2.PG_REMOVED)
    assert model.heartbeat("node-2", [], [], [], now=12) == (True, [])
    assert model.heartbeat("node-9", [], [], [], now=12) == (True, [])


def test_session_expiry_removes_owned_but_not_detached():
    model = _model()
    s = model.open_session("script", 5, now=0)
    owned = model.create_placement_group("owned", [ONE_GPU], 1, False, s.id, now=0)
    kept = model.create_placement_group("kept", [ONE_GPU], 1, True, s.id, now=0)
    [w] = model.create_workers([_spec(owned.id)], s.id, 0, 1, now=0)
    [d] = model.create_workers([_spec(kept.id, group="det", detached=True)], s.id, 0, 1, now=0)
    assert kept.owner == "" and d.owner == ""
    assert model.keep_alive(s.id, now=4)
    model.expire(now=8)
    assert owned.state == common_pb2.PG_CREATED
    effects = model.expire(now=10)
    assert owned.state == common_pb2.PG_REMOVED and kept.state == common_pb2.PG_CREATED
    assert w.state == common_pb2.WORKER_EXITED and d.state == common_pb2.WORKER_STARTING
    assert effects.stop == {w.node_id: [w.id]}
    assert not model.keep_alive(s.id, now=11)


def test_restored_leases_wait_for_the_restore_grace_then_apply():
    """A restarted scheduler gives its agents and controllers restore_grace seconds to come
    back (they were backing off while it was down) before any lease is enforced."""
    old = _model(nodes=(2, 3))
    s = old.open_session("script", 2, now=0)
    pg = old.create_placement_group("p", [ONE_GPU], 1, False, s.id, now=0)
    model = ClusterModel(node_lease=3, default_session_lease=2, restore_grace=10)
    model.restore(old.nodes.values(), old.groups.values(), old.workers.values(),
                  old.sessions.values(), now=100)
    model.heartbeat("node-2", [], [], [], now=108)
    model.expire(now=109)                   # past every lease, within the grace: nothing ends
    assert {n.state for n in model.nodes.values()} == {common_pb2.NODE_ALIVE}
    assert s.id in model.sessions and model.groups[pg.id].state == common_pb2.PG_CREATED
    model.expire(now=110.5)                 # grace over: node-3 and the session never came back
    assert model.nodes["node-2"].state == common_pb2.NODE_ALIVE
    assert model.nodes["node-3"].state == common_pb2.NODE_DEAD
    assert s.id not in model.sessions and model.groups[pg.id].state == common_pb2.PG_REMOVED


def test_a_fresh_scheduler_has_no_restore_grace():
    model = ClusterModel(node_lease=3, restore_grace=10)
    model.restore([], [], [], [], now=0)    # an empty state file
    model.register_node(_node(2), [], now=0)
    model.expire(now=4)
    assert model.nodes["node-2"].state == common_pb2.NODE_DEAD


def test_heartbeat_lists_workers_the_scheduler_no_longer_wants():
    model = _model()
    pg = model.create_placement_group("p", [ONE_GPU], 1, False, "", now=0)
    [w] = model.create_workers([_spec(pg.id)], "", 0, 1, now=0)
    node = w.node_id
    running = [scheduler_pb2.RunningWorker(worker_id=w.id, pid=5, port=9000),
               scheduler_pb2.RunningWorker(worker_id="w-stray", pid=6)]
    assert model.heartbeat(node, [], [], running, now=1) == (False, ["w-stray"])
    assert w.state == common_pb2.WORKER_RUNNING and w.port == 9000
    model.remove_workers([w.id], now=2)
    assert model.heartbeat(node, [], [], running, now=3) == (False, [w.id, "w-stray"])


def test_dirty_tracking_names_exactly_the_changed_records():
    model = _model()
    model.take_dirty()
    pg = model.create_placement_group("p", [ONE_GPU], 1, False, "", now=0)
    dirty = model.take_dirty()
    assert list(dirty.groups) == [pg.id] and not dirty.workers and not dirty.nodes
    assert not model.take_dirty()


def test_prune_forgets_the_oldest_ended_records_only():
    model = _model(max_ended=2)
    pg = model.create_placement_group("p", [{"CPU": 8, "GPU": 1}], 1, False, "", now=0)
    workers = model.create_workers([_spec(pg.id, r, world=5, num_gpus=0.125) for r in range(5)],
                                   "", 0, 1, now=0)
    model.remove_workers([w.id for w in workers[:4]], now=1)
    model.take_dirty()
    model.expire(now=2)
    assert list(model.workers) == [w.id for w in workers[2:]]
    assert set(model.take_dirty().workers) == {workers[0].id, workers[1].id}


def test_re_registration_reattaches_running_workers_and_ends_lost_ones():
    model = _model(nodes=(2,))
    pg = model.create_placement_group("p", [ONE_GPU] * 3, 1, False, "", now=0)
    kept, lost, unspawned = model.create_workers(
        [_spec(pg.id, r, bundle=r, world=3) for r in range(3)], "", 0, 1, now=0)
    model.mark_spawned(kept.id, 11, "/log/kept")
    model.mark_spawned(lost.id, 12, "/log/lost")
    effects = model.register_node(_node(2), [
        scheduler_pb2.RunningWorker(worker_id=kept.id, pid=11, port=9001),
        scheduler_pb2.RunningWorker(worker_id="w-unknown", pid=13)], now=1)
    assert effects.stop == {"node-2": ["w-unknown"]}
    assert (kept.state, kept.port) == (common_pb2.WORKER_RUNNING, 9001)
    assert lost.state == common_pb2.WORKER_EXITED and "re-registered" in lost.exit.reason
    assert unspawned.state == common_pb2.WORKER_STARTING
    assert pg.state == common_pb2.PG_CREATED
