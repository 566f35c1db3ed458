"""Real processes: one ``podium scheduler``, real ``podium node`` agents on their own
loopback addresses, workers placed by the scheduler. Checks registration, the
worker bootstrap end to end, and that stopping or killing an agent leaves no
process behind.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from podium import rpc
from podium.scheduler.client import SchedulerClient
from podium.v1 import common_pb2, node_pb2, node_pb2_grpc
from tests.support.processes import FAKE_WORKER, wait_for
from tests.support.proctable import alive, members_of_groups

pytestmark = pytest.mark.cluster

DEADLINE = 30.0


@pytest.fixture
def leftovers():
    """Pids a test started indirectly (workers); any still alive at teardown get SIGKILL,
    so a failing test leaks nothing."""
    pids: set[int] = set()
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def http_json(url: str, token: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


async def place_workers(address: str, token: str, count: int, strategy: str, env=None):
    """Open a session, reserve ``count`` one-GPU bundles, start one worker per bundle, wait RUNNING."""
    async with SchedulerClient(address, token, timeout=20) as client:
        session = await client.open_session("agent cluster test", lease_seconds=120)
        group = await client.create_placement_group(f"pg-{strategy}", [{"CPU": 1, "GPU": 1}] * count,
                                                    strategy, owner=session.session_id)
        await client.wait_placement_group(group.id, timeout=20)
        specs = [common_pb2.WorkerSpec(name=f"w_{r}", group="grp", placement_group_id=group.id,
                                       bundle_index=r, num_gpus=1, num_cpus=1, rank=r,
                                       world_size=count, env=env or {})
                 for r in range(count)]
        workers = await client.create_workers(specs, owner=session.session_id)
        return await client.wait_workers([w.id for w in workers], timeout=DEADLINE)


async def workers_by_id(address: str, token: str, ids):
    async with SchedulerClient(address, token, timeout=20) as client:
        return {w.id: w for w in await client.get_workers(ids=ids)}


def test_two_agents_register_and_run_real_workers_then_sigterm_cleans_up(
        scheduler_process, agents, token, arun, leftovers):
    scheduler = scheduler_process()
    a = agents(scheduler.address, "127.0.0.2")
    b = agents(scheduler.address, "127.0.0.3")

    def registered():
        nodes = http_json(scheduler.http_url + "/v1/nodes", token)["nodes"]
        return {n["info"]["address"]: n for n in nodes} if len(nodes) == 2 else None

    nodes = wait_for(registered, "both agents in /v1/nodes")
    assert set(nodes) == {"127.0.0.2", "127.0.0.3"}
    for agent in (a, b):
        info = nodes[agent.host]["info"]
        assert info["node_id"] == agent.node_id and info["agent_port"] == agent.port
        assert len(info["gpus"]) == 2 and nodes[agent.host]["state"] == "NODE_ALIVE"

    # The default worker command: the real podium.worker.host.process, bootstrapped over the ready fd.
    workers = arun(place_workers(scheduler.address, token, 2, "STRICT_SPREAD"), timeout=90)
    leftovers.update(w.pid for w in workers)
    assert sorted(w.node_address for w in workers) == ["127.0.0.2", "127.0.0.3"]
    for w in workers:
        assert w.state == common_pb2.WORKER_RUNNING and w.pid > 0 and w.port > 0 and alive(w.pid)
        channel = rpc.make_sync_channel(f"{w.node_address}:{w.port}")
        try:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), metadata=rpc.token_metadata(token), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            channel.close()
    on_a = next(w for w in workers if w.node_address == a.host)
    on_b = next(w for w in workers if w.node_address == b.host)

    # Its log file is on node a, readable through a's TailLog.
    channel = rpc.make_sync_channel(f"{a.host}:{a.port}")
    try:
        lines = list(node_pb2_grpc.NodeAgentStub(channel).TailLog(
            node_pb2.TailLogRequest(worker_id=on_a.id), metadata=rpc.token_metadata(token), timeout=10))
    finally:
        channel.close()
    assert any("serving on" in line.text for line in lines), [l.text for l in lines]

    assert a.signal(signal.SIGTERM) == 0
    assert not alive(on_a.pid) and members_of_groups({on_a.pid}) == []
    assert alive(on_b.pid)
    seen = arun(workers_by_id(scheduler.address, token, [on_a.id, on_b.id]))
    assert seen[on_a.id].state == common_pb2.WORKER_EXITED and seen[on_a.id].exit.requested
    assert seen[on_b.id].state == common_pb2.WORKER_RUNNING

    assert b.signal(signal.SIGTERM) == 0
    assert not alive(on_b.pid)


def test_sigterm_agent_kills_whole_worker_trees_even_if_they_ignore_sigterm(
        scheduler_process, agents, token, arun, tmp_path, leftovers):
    scheduler = scheduler_process()
    agent = agents(scheduler.address, "127.0.0.2", "--worker-command", f"{sys.executable} {FAKE_WORKER}")
    env = {"FAKE_MODE": "ignore_term", "FAKE_CHILD_PID_FILE": str(tmp_path / "child-{pid}")}
    workers = arun(place_workers(scheduler.address, token, 2, "STRICT_PACK", env), timeout=90)
    pids = {w.pid for w in workers}
    leftovers.update(pids)
    children = {int((tmp_path / f"child-{pid}").read_text()) for pid in pids}
    leftovers.update(children)
    assert all(alive(pid) for pid in pids | children)
    assert set(members_of_groups(pids)) >= pids | children

    assert agent.signal(signal.SIGTERM) == 0
    assert members_of_groups(pids) == []
    assert not any(alive(pid) for pid in pids | children)
    seen = arun(workers_by_id(scheduler.address, token, [w.id for w in workers]))
    for w in seen.values():
        assert (w.state, w.exit.signal, w.exit.requested) == (common_pb2.WORKER_EXITED, 9, True)


def test_sigkilled_agent_takes_its_workers_with_it(scheduler_process, agents, token, arun, leftovers):
    scheduler = scheduler_process()
    agent = agents(scheduler.address, "127.0.0.2", "--worker-command", f"{sys.executable} {FAKE_WORKER}")
    workers = arun(place_workers(scheduler.address, token, 2, "STRICT_PACK"), timeout=90)
    pids = {w.pid for w in workers}
    leftovers.update(pids)
    assert all(alive(pid) for pid in pids)
    assert agent.signal(signal.SIGKILL) == -signal.SIGKILL
    # The kernel's parent-death signal, not the agent, ends them.
    wait_for(lambda: not any(alive(pid) for pid in pids), "workers of a SIGKILLed agent to die")


def test_workers_survive_a_scheduler_restart_and_the_agent_reconnects(
        scheduler_process, agents, token, arun, tmp_path, leftovers):
    state = tmp_path / "state.db"
    first = scheduler_process(state)
    agent = agents(first.address, "127.0.0.2", "--worker-command", f"{sys.executable} {FAKE_WORKER}")
    workers = arun(place_workers(first.address, token, 1, "STRICT_PACK"), timeout=90)
    leftovers.update(w.pid for w in workers)
    port = first.port
    assert first.kill(signal.SIGKILL) == -signal.SIGKILL
    time.sleep(0.5)  # the agent's heartbeats fail meanwhile; it must keep going
    assert agent.proc.poll() is None and all(alive(w.pid) for w in workers)

    second = scheduler_process(state, "--port", str(port))
    restored_at = time.time()  # the state is loaded before the port file appears

    def heartbeating():
        # A heartbeat (or registration) newer than the restore: the agent found it again.
        nodes = http_json(second.http_url + "/v1/nodes", token)["nodes"]
        return (nodes and nodes[0]["state"] == "NODE_ALIVE"
                and float(nodes[0].get("last_heartbeat", 0)) > restored_at)

    wait_for(heartbeating, "the agent heartbeating the restarted scheduler")
    seen = arun(workers_by_id(second.address, token, [w.id for w in workers]))
    for w in workers:
        assert seen[w.id].state == common_pb2.WORKER_RUNNING and seen[w.id].pid == w.pid
        assert alive(w.pid)
    assert agent.signal(signal.SIGTERM) == 0
    assert not any(alive(w.pid) for w in workers)
