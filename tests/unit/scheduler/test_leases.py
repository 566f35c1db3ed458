"""LeaseChecker alone, over a real ClusterModel and an empty HeartbeatStreams (no sockets):
one check expires what ran out and hands the effects to ``settle``; a check after a stall of
the loop restarts every lease instead."""

from __future__ import annotations

import asyncio

from podium.scheduler.heartbeats import HeartbeatStreams
from podium.scheduler.leases import STALL_SECONDS, LeaseChecker
from podium.scheduler.state import ClusterModel
from podium.v1 import common_pb2


def _setup(now: list[float]):
    model = ClusterModel(node_lease=10, default_session_lease=30)
    for n in (1, 2):
        model.register_node(common_pb2.NodeInfo(node_id=f"n{n}", address=f"10.0.0.{n}", agent_port=7000,
                                                cpus=8, gpus=[common_pb2.GpuInfo(index=0, uuid=f"G{n}")]),
                            [], now=0)
    group = model.create_placement_group("g", [{"CPU": 1, "GPU": 1}] * 2, common_pb2.SPREAD, True, "", 0)
    spec = [common_pb2.WorkerSpec(name=f"w{r}", group="wg", placement_group_id=group.id, bundle_index=r,
                                  num_gpus=1, num_cpus=1, rank=r, world_size=2) for r in (0, 1)]
    workers = model.create_workers(spec, "", 0, 29500, now=0)
    for worker in workers:
        model.mark_spawned(worker.id, pid=100, log_path="")
    settled = []

    async def settle(effects):
        settled.append(effects)

    checker = LeaseChecker(model, HeartbeatStreams(), clock=lambda: now[0], node_lease=10,
                           session_lease=30, settle=settle)
    return model, checker, settled, workers


def test_the_interval_is_a_quarter_of_the_shorter_lease_unless_given():
    model = ClusterModel()

    async def settle(effects):
        pass

    assert LeaseChecker(model, HeartbeatStreams(), clock=lambda: 0.0, node_lease=8, session_lease=30,
                        settle=settle).interval == 2
    assert LeaseChecker(model, HeartbeatStreams(), clock=lambda: 0.0, node_lease=8, session_lease=30,
                        settle=settle, interval=0.5).interval == 0.5
    assert LeaseChecker(model, HeartbeatStreams(), clock=lambda: 0.0, node_lease=0.04, session_lease=30,
                        settle=settle).interval == 0.05


def test_a_check_expires_a_silent_node_and_settles_the_stops(arun):
    now = [5.0]
    model, checker, settled, workers = _setup(now)
    model.heartbeat("n2", [], [], [], now=5)
    arun(checker.check())
    assert model.nodes["n1"].state == common_pb2.NODE_ALIVE and len(settled) == 1
    now[0] = 12.0  # n1 silent since 0, n2 since 5: only n1's lease ran out
    arun(checker.check())
    assert model.nodes["n1"].state == common_pb2.NODE_DEAD
    assert model.nodes["n2"].state == common_pb2.NODE_ALIVE
    on_n2 = [w.id for w in workers if w.node_id == "n2"]
    # The group had a bundle on n1: it goes, and its worker on n2 is stopped there.
    assert settled[-1].stop == {"n2": on_n2}


def test_a_check_after_a_stall_restarts_the_leases_instead(arun):
    now = [12.0]
    model, checker, settled, _ = _setup(now)
    arun(checker.check(stalled_for=STALL_SECONDS + 1))
    assert all(n.state == common_pb2.NODE_ALIVE for n in model.nodes.values())
    assert settled[-1].stop == {}
    now[0] = 23.0  # a whole lease of silence after the stall ended
    arun(checker.check())
    assert all(n.state == common_pb2.NODE_DEAD for n in model.nodes.values())


def test_start_and_stop_run_the_background_task(arun):
    now = [0.0]
    _, checker, settled, _ = _setup(now)
    checker.interval = 0.01

    async def scenario():
        checker.start()
        checker.start()  # a second start keeps the one task
        while not settled:
            await asyncio.sleep(0.01)
        await checker.stop()
        count = len(settled)
        await asyncio.sleep(0.05)
        return count

    count = arun(scenario())
    assert len(settled) == count  # nothing runs after stop
