"""WorkerTable alone, over real group, node and session tables: slots, creation and env,
agent reports, reconciling what an agent runs, stops, spawn deadlines and pruning."""

import itertools

import pytest

from podium import errors
from podium.scheduler.groups import GroupTable
from podium.scheduler.nodes import NodeTable
from podium.scheduler.sessions import SessionTable
from podium.scheduler.tables import ChangeLog
from podium.scheduler.workers import WorkerTable
from podium.v1 import common_pb2, scheduler_pb2


def _info(n):
    return common_pb2.NodeInfo(node_id=f"n{n}", address=f"10.0.0.{n}", agent_port=7000 + n, cpus=8,
                               gpus=[common_pb2.GpuInfo(index=i, uuid=f"G{n}{i}") for i in range(2)])


def _tables(spawn_deadline=40.0):
    changes = ChangeLog()
    counter = itertools.count()
    new_id = lambda prefix: f"{prefix}-{next(counter)}"  # noqa: E731
    nodes = NodeTable(changes)
    sessions = SessionTable(changes, new_id=new_id)
    groups = GroupTable(changes, nodes, sessions, new_id=new_id)
    nodes.register(_info(1), now=0)
    group = groups.create("g", [{"CPU": 2, "GPU": 1}] * 2, common_pb2.PACK, True, "", now=0)
    workers = WorkerTable(changes, groups, sessions, new_id=new_id, spawn_deadline=spawn_deadline)
    return workers, group, sessions, changes


def _spec(group, rank, bundle=None, world=2, **kw):
    return common_pb2.WorkerSpec(name=f"w{rank}", group="wg", placement_group_id=group.id,
                                 bundle_index=rank if bundle is None else bundle, num_gpus=1, num_cpus=1,
                                 rank=rank, world_size=world, **kw)


def test_create_reserves_slots_and_sets_the_system_env():
    workers, group, _, changes = _tables()
    changes.take()
    plan = workers.plan([_spec(group, 0), _spec(group, 1)], "", 0)
    assert plan.need_port and plan.node_id == "n1"
    made = workers.create([_spec(group, 0), _spec(group, 1)], "", 0, 29500, now=1)
    assert [w.state for w in made] == [common_pb2.WORKER_STARTING] * 2
    assert made[1].env["RANK"] == "1" and made[1].env["MASTER_PORT"] == "29500"
    assert made[0].env["OMP_NUM_THREADS"] == "1"
    assert list(changes.take().workers) == [w.id for w in made]
    assert workers.of_group(group.id) == made and workers.on_node("n1") == made
    assert workers.select(group="wg") == made and workers.select(names=["w1"]) == [made[1]]


def test_a_full_bundle_refuses_and_changes_nothing():
    workers, group, _, changes = _tables()
    workers.create([_spec(group, 0)], "", 0, 29500, now=1)
    changes.take()
    with pytest.raises(errors.SlotFullError, match="bundle 0 .* is full"):
        workers.create([_spec(group, 1, bundle=0)], "", 0, 29500, now=2)
    assert len(workers) == 1 and not changes.pending()


def test_an_unknown_owner_or_a_taken_rank_is_refused():
    workers, group, _, _ = _tables()
    with pytest.raises(errors.NotFoundError, match="session"):
        workers.plan([_spec(group, 0)], "s-unknown", 0)
    workers.create([_spec(group, 0)], "", 0, 29500, now=1)
    with pytest.raises(errors.InvalidArgumentError, match="already taken"):
        workers.plan([common_pb2.WorkerSpec(name="other", group="wg", placement_group_id=group.id,
                                            bundle_index=1, num_gpus=1, num_cpus=1, rank=0,
                                            world_size=2)], "", 0)
    # A later call's master is the live rank-0 worker of the same group.
    plan = workers.plan([_spec(group, 1)], "", 0)
    assert not plan.need_port and plan.port == 29500


def test_reports_and_reconcile_move_a_worker_through_its_states():
    workers, group, _, _ = _tables()
    w0, w1 = workers.create([_spec(group, 0), _spec(group, 1)], "", 0, 29500, now=1)
    workers.report(scheduler_pb2.ReportWorkerRequest(worker_id=w0.id, node_id="n1",
                                                     state=common_pb2.WORKER_RUNNING, port=5000, pid=7))
    assert (w0.state, w0.port, w0.pid) == (common_pb2.WORKER_RUNNING, 5000, 7)
    with pytest.raises(errors.InvalidArgumentError, match="not 'n9'"):
        workers.report(scheduler_pb2.ReportWorkerRequest(worker_id=w0.id, node_id="n9",
                                                         state=common_pb2.WORKER_RUNNING, port=1))
    running = [scheduler_pb2.RunningWorker(worker_id=w1.id, pid=8, port=5001),
               scheduler_pb2.RunningWorker(worker_id="w-stray", pid=9)]
    effects = workers.reconcile("n1", running, registering=True)
    assert effects.stop == {"n1": ["w-stray"]}
    assert w1.state == common_pb2.WORKER_RUNNING and w1.pid == 8
    # w0 has a pid and the re-registered agent no longer lists it: it died with the agent.
    assert w0.state == common_pb2.WORKER_EXITED and "re-registered" in w0.exit.reason


def test_stops_end_workers_and_free_their_slots():
    workers, group, sessions, _ = _tables()
    session = sessions.open("ctl", 10, now=0)
    owned = workers.create([_spec(group, 0)], session.id, 0, 29500, now=1)[0]
    other = workers.create([_spec(group, 1)], "", 0, 29500, now=1)[0]
    count, effects = workers.stop_owned(session.id, "closed")
    assert count == 1 and effects.stop == {"n1": [owned.id]} and owned.exit.requested
    assert other.state == common_pb2.WORKER_STARTING
    count, effects = workers.stop_group(group.id, "removed")
    assert count == 1 and effects.stop == {"n1": [other.id]}
    # The slot is free again at once.
    workers.create([_spec(group, 0)], "", 0, 29500, now=2)


def test_end_on_node_and_remove():
    workers, group, _, _ = _tables()
    w0, w1 = workers.create([_spec(group, 0), _spec(group, 1)], "", 0, 29500, now=1)
    stopped, effects = workers.remove([w0.id])
    assert stopped == 1 and effects.stop == {"n1": [w0.id]}
    workers.end_on_node("n1", "node n1 died")
    assert w1.state == common_pb2.WORKER_EXITED and w1.exit.reason == "node n1 died"
    assert not w1.exit.requested
    with pytest.raises(errors.NotFoundError):
        workers.remove(["w-unknown"])


def test_a_worker_never_given_a_pid_fails_at_its_spawn_deadline():
    workers, group, _, _ = _tables(spawn_deadline=5)
    slow, spawned = workers.create([_spec(group, 0), _spec(group, 1)], "", 0, 29500, now=1)
    workers.mark_spawned(spawned.id, pid=11, log_path="/tmp/w.log")
    assert workers.resolve_unspawned(now=5).stop == {}
    effects = workers.resolve_unspawned(now=6)
    assert effects.stop == {"n1": [slow.id]} and slow.state == common_pb2.WORKER_FAILED
    assert spawned.state == common_pb2.WORKER_STARTING and spawned.log_path == "/tmp/w.log"


def test_prune_forgets_the_oldest_ended_and_restore_indexes_again():
    workers, group, _, changes = _tables()
    w0, w1 = workers.create([_spec(group, 0), _spec(group, 1)], "", 0, 29500, now=1)
    workers.remove([w0.id, w1.id])
    changes.take()
    workers.prune(keep=1)
    assert list(workers) == [w1.id] and list(changes.take().workers) == [w0.id]
    assert workers.of_group(group.id) == [w1] and workers.on_node("n1") == [w1]
    fresh, _, _, _ = _tables()
    starting = common_pb2.WorkerInfo(id="w-s", node_id="n1", state=common_pb2.WORKER_STARTING)
    starting.spec.placement_group_id = group.id
    fresh.restore([w1, starting], unspawned_until=20)
    assert fresh.on_node("n1") == [w1, starting]
    assert fresh.resolve_unspawned(now=19).stop == {}
    assert fresh.resolve_unspawned(now=20).stop == {"n1": ["w-s"]}


def test_workers_created_for_restarted_actors_are_counted_for_metrics():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from podium.scheduler.workers import RestartsCollector

    workers, group, _, _ = _tables()
    registry = CollectorRegistry()
    registry.register(RestartsCollector(SimpleNamespace(workers=workers)))
    workers.create([_spec(group, 0, max_restarts=-1)], "", 0, 29500, now=1)
    assert workers.actor_restarts == 0
    workers.create([_spec(group, 1, restarts=3, max_restarts=-1)], "", 0, 29500, now=1)
    assert workers.actor_restarts == 1
    assert "podium_actor_restarts_total 1.0" in generate_latest(registry).decode()
