"""Issue #14 on the pure ClusterModel: stalls excuse leases, unspawned workers fail in time."""

from __future__ import annotations

import pytest

from podium import errors, limits
from podium.scheduler.state import ClusterModel
from podium.v1 import common_pb2


def _model(**kw) -> ClusterModel:
    model = ClusterModel(node_lease=10, default_session_lease=30, **kw)
    model.register_node(common_pb2.NodeInfo(node_id="n", address="10.0.0.2", agent_port=7000, cpus=8,
                                            gpus=[common_pb2.GpuInfo(index=0, uuid="G0")]), [], now=0)
    return model


def _spec(pg_id: str, name: str = "w") -> common_pb2.WorkerSpec:
    return common_pb2.WorkerSpec(name=name, group=name, placement_group_id=pg_id, num_gpus=1,
                                 num_cpus=1, world_size=1)


def test_a_stall_restarts_every_lease_at_its_end():
    model = _model()
    session = model.open_session("c", 5, now=0)
    model.excuse_stall(now=20)          # the scheduler could not listen from ~0 to 20
    model.expire(now=21)
    assert model.nodes["n"].state == common_pb2.NODE_ALIVE and session.id in model.sessions
    model.expire(now=31)                # silent for a whole lease after the stall ended
    assert model.nodes["n"].state == common_pb2.NODE_DEAD and session.id not in model.sessions


def test_a_worker_no_agent_gave_a_pid_fails_at_its_spawn_deadline_and_frees_its_slot():
    model = _model(spawn_deadline=40)
    pg = model.create_placement_group("pg", [{"GPU": 1, "CPU": 1}], 1, False, "", now=0)
    [worker] = model.create_workers([_spec(pg.id)], "", 0, 29500, now=0)
    for t in range(0, 40, 9):
        model.heartbeat("n", [], [], [], now=t)
        assert model.expire(now=t).stop == {}
    model.heartbeat("n", [], [], [], now=40)
    effects = model.expire(now=40)
    assert worker.state == common_pb2.WORKER_FAILED and "never spawned" in worker.exit.reason
    assert effects.stop == {"n": [worker.id]}
    model.create_workers([_spec(pg.id, "again")], "", 0, 29500, now=41)  # the slot is free


def test_a_spawned_worker_is_never_failed_by_the_spawn_deadline():
    model = _model(spawn_deadline=40)
    pg = model.create_placement_group("pg", [{"GPU": 1, "CPU": 1}], 1, False, "", now=0)
    [worker] = model.create_workers([_spec(pg.id)], "", 0, 29500, now=0)
    model.mark_spawned(worker.id, 4242, "/tmp/w.out")
    model.heartbeat("n", [], [], [], now=45)
    model.expire(now=45)
    assert worker.state == common_pb2.WORKER_STARTING


def test_bundle_count_is_bounded_in_the_model_too():
    model = _model()
    with pytest.raises(errors.InvalidArgumentError, match="limit of 10000"):
        model.create_placement_group("big", [{"CPU": 0.0001}] * (limits.MAX_BUNDLES + 1), 1, False, "", now=0)
    assert model.groups == {}


@pytest.mark.parametrize("lease", [float("inf"), 1e300, limits.MAX_SESSION_LEASE_SECONDS * 2])
def test_session_leases_are_bounded(lease):
    with pytest.raises(errors.InvalidArgumentError, match="lease_seconds"):
        _model().open_session("c", lease, now=0)
