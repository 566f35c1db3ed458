"""The scheduler killed with SIGKILL and restarted on the same state (issue 7, item 4).

While it is down, the running WorkerGroup keeps serving calls (the data path never goes
through the scheduler). The restarted scheduler (same SQLite file, same port) gets its node
agents back, and the nodes, placement groups and workers it restored equal what was there
before the kill, compared field by field (heartbeat times and memory readings aside).
"""

from __future__ import annotations

import signal
import time

import pytest
import torch
from google.protobuf.json_format import MessageToDict

import podium

from tests.support.faultkit import SCHEDULER_FLAGS, FaultCluster, elapsed, report, wait_for
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.dataproto import DataProto
from podium.errors import UnavailableError
from podium.v1 import common_pb2
from podium.worker import Dispatch, Worker, register

pytestmark = [pytest.mark.cluster, pytest.mark.faults, pytest.mark.timeout(240)]

#: Seconds the scheduler stays down.
OUTAGE = 8.0


class Counter(Worker):
    """Counts its calls (state that must survive the scheduler's restart)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def bump(self):
        self.calls += 1
        return self.calls


def _comparable(state) -> dict:
    """ClusterState as plain dicts by id, without what changes with every heartbeat."""
    nodes = {}
    for node in state.nodes:
        d = MessageToDict(node, preserving_proto_field_name=True)
        d.pop("last_heartbeat", None)
        d.pop("processes", None)  # per-process memory readings of the latest heartbeat
        for gpu in d.get("info", {}).get("gpus", []):
            gpu.pop("memory_used_bytes", None)
        nodes[node.info.node_id] = d
    groups = {g.id: MessageToDict(g, preserving_proto_field_name=True) for g in state.placement_groups}
    workers = {w.id: MessageToDict(w, preserving_proto_field_name=True) for w in state.workers}
    return {"nodes": nodes, "placement_groups": groups, "workers": workers}


def _assert_same(before: dict, after: dict) -> None:
    for kind in before:
        assert set(after[kind]) == set(before[kind]), kind
        for key, record in before[kind].items():
            for field in set(record) | set(after[kind][key]):
                assert after[kind][key].get(field) == record.get(field), (kind, key, field)


def test_scheduler_sigkill_restart_keeps_groups_serving_and_state_equal(
        scheduler_process, agents, token, tmp_path):
    state_file = tmp_path / "state.db"
    fc = FaultCluster(scheduler_process, agents, token, ("127.0.0.2", "127.0.0.3"), state=state_file)
    rt = fc.connect(call_timeout=60, session_lease=30)
    try:
        wg = WorkerGroup(ResourcePool([2, 2], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Counter))
        assert wg.bump() == [1] * 4
        before = _comparable(rt.run(rt.cluster_state()))
        assert len(before["workers"]) == 4 and len(before["placement_groups"]) == 2

        port = fc.scheduler.port
        assert fc.scheduler.kill(signal.SIGKILL) == -signal.SIGKILL
        down = time.monotonic()
        # Down: the group still serves, from this process straight to its workers.
        served = [wg.bump() for _ in range(5)]
        assert served == [[n] * 4 for n in range(2, 7)]
        report("scheduler SIGKILL: calls while it is down", elapsed(down) / 5,
               "5 calls on 4 ranks served normally (mean seconds per call)")
        # Down long enough for the controller's keep-alives and the agents' heartbeats to fail
        # several times (their channels back off), and longer than the node lease.
        time.sleep(OUTAGE)

        fc.scheduler = scheduler_process(state_file, *SCHEDULER_FLAGS, "--port", str(port))
        restarted = time.time()

        def reattached():
            nodes = fc.placement()["nodes"]
            return len(nodes) == 2 and all(n["state"] == "NODE_ALIVE" and n["last_heartbeat"] > restarted
                                           for n in nodes)

        started = time.monotonic()
        wait_for(reattached, "both agents heartbeating the restarted scheduler")
        report("scheduler SIGKILL+restart: agents re-attached", elapsed(started), "both nodes NODE_ALIVE")

        def reached():
            # The controller's channel reconnects on its own (backoff at most ~2 s).
            try:
                return rt.run(rt.cluster_state(), timeout=10)
            except UnavailableError:
                return None

        after = _comparable(wait_for(reached, "the controller reaching the restarted scheduler"))
        report("scheduler SIGKILL+restart: controller reaches it", elapsed(started), "cluster state read")
        _assert_same(before, after)

        # Still one cluster: calls, and the restored session may create more.
        assert wg.bump() == [7] * 4
        wg.shutdown()  # (its 4 workers hold every GPU of the cluster)
        wait_for(lambda: fc.busy() == ([], []), "every slot free after teardown")
        more = WorkerGroup(ResourcePool([1, 1], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Counter))
        assert more.bump() == [1, 1]
        more.shutdown()
        wait_for(lambda: fc.busy() == ([], []), "every slot free after teardown")
    finally:
        fc.close()


class Producer(Worker):
    """Makes rows and keeps them in the worker (a DataProtoFuture's source)."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make(self, data):
        data.batch["a"] += 100 * self.rank
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, a, b):
        return a + b

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        import os
        return os.getpid()


class Consumer(Worker):
    """Reads a future's rows from the producers itself (worker to worker)."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def consume(self, data):
        return DataProto.from_dict(tensors={"a": data.batch["a"] * 10})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        import os
        return os.getpid()


def _step(producers, consumers, actor, step: int) -> None:
    """One step of a GRPO-shaped loop: generate (a future), consume it worker to worker,
    put the new weights, hand them to the actors, call a task."""
    batch = DataProto.from_dict(tensors={"a": torch.arange(8, dtype=torch.float32) + step})
    future = producers.make(batch)
    out = consumers.consume(future)
    expected = (torch.arange(8, dtype=torch.float32) + step + torch.tensor([0.0] * 4 + [100.0] * 4)) * 10
    assert torch.equal(out.batch["a"], expected), (step, out.batch["a"])
    weights = podium.put(torch.full((1024,), float(step)))
    assert [float(t.sum()) for t in producers.add(weights, 1)] == [1024.0 * (step + 1)] * 2
    assert podium.get(actor.bump.remote(step)) == step


def test_a_training_loop_runs_through_a_scheduler_outage_and_nothing_is_killed(
        scheduler_process, agents, token, tmp_path, monkeypatch):
    """Groups, DataProtoFutures, puts and actor calls go on while the scheduler is down (none of
    them passes through it); creating a group meanwhile fails within its deadline, naming the
    scheduler; the restarted scheduler reconciles with the agents and kills no live worker."""
    state_file = tmp_path / "state.db"
    fc = FaultCluster(scheduler_process, agents, token, ("127.0.0.2", "127.0.0.3"), state=state_file)
    monkeypatch.setenv("PODIUM_SCHEDULER_TIMEOUT", "3")  # how long a scheduler call waits for it
    rt = fc.connect(call_timeout=60, session_lease=30)
    try:
        producers = WorkerGroup(ResourcePool([2], use_gpu=True, max_colocate_count=1, name_prefix="prod"),
                                ClassWithInitArgs(Producer))
        consumers = WorkerGroup(ResourcePool([2], use_gpu=True, max_colocate_count=1, name_prefix="cons"),
                                ClassWithInitArgs(Consumer))

        @podium.remote(num_cpus=0.5)
        class Tracker:
            def bump(self, step):
                return step

        actor = Tracker.remote()
        _step(producers, consumers, actor, 0)
        pids = (producers.pid(), consumers.pid())
        live_before = {w.id for w in rt.run(rt.cluster_state()).workers
                       if w.state == common_pb2.WORKER_RUNNING}

        port = fc.scheduler.port
        assert fc.scheduler.kill(signal.SIGKILL) == -signal.SIGKILL
        down = time.monotonic()
        steps = 1
        while time.monotonic() - down < OUTAGE / 2:
            _step(producers, consumers, actor, steps)
            steps += 1
        report("scheduler SIGKILL: loop steps while it is down", elapsed(down) / (steps - 1),
               f"{steps - 1} steps (futures, puts, actor calls) served normally (mean seconds per step)")

        # A new group needs the scheduler: it waits within the call's deadline, then says why.
        asked = time.monotonic()
        with pytest.raises(UnavailableError) as info:
            WorkerGroup(ResourcePool([1], use_gpu=True, max_colocate_count=1, name_prefix="late"),
                        ClassWithInitArgs(Consumer))
        assert f"scheduler 127.0.0.1:{port}" in str(info.value) and "unreachable" in str(info.value), info.value
        report("scheduler down: creating a group", elapsed(asked), str(info.value))

        fc.scheduler = scheduler_process(state_file, *SCHEDULER_FLAGS, "--port", str(port))
        restarted = time.time()
        wait_for(lambda: all(n["state"] == "NODE_ALIVE" and n["last_heartbeat"] > restarted
                             for n in fc.placement()["nodes"]), "both agents back with the scheduler")
        for step in range(steps, steps + 3):
            _step(producers, consumers, actor, step)
        # Reconciled, nothing killed: the same processes serve, the same workers are running,
        # and no slot holds two of them.
        assert (producers.pid(), consumers.pid()) == pids
        state = rt.run(rt.cluster_state())
        assert {w.id for w in state.workers if w.state == common_pb2.WORKER_RUNNING} == live_before
        slots = [w["worker_id"] for node in fc.placement()["nodes"] for gpu in node["gpus"]
                 for w in gpu["workers"]]
        assert slots and len(slots) == len(set(slots))
    finally:
        fc.close()
