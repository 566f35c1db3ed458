"""Issue #14, items 5, 6 and 11 on the node agent: env the OS cannot carry is refused
naming the variable, a spawn the OS rejects ends FAILED with the reason (no ghost),
worker logs are private, and port holds and stop graces are bounded."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from podium import errors, limits
from podium.resources import check_user_env
from podium.v1 import common_pb2, node_pb2
from podium.worker.agent.spawner import Spawner
from tests.support.agentkit import FAKE_WORKER, WAIT, node, rpc_error, run, spawn_running, worker

pytestmark = pytest.mark.faults


@pytest.mark.parametrize("env, named", [({"X": "a\x00b"}, "'X'"), ({"A=B": "1"}, "'A=B'"),
                                        ({"": "1"}, "''"), ({"N\x00UL": "1"}, "N")])
def test_the_sdk_refuses_env_the_os_cannot_carry_naming_the_variable(env, named):
    with pytest.raises(errors.InvalidArgumentError) as info:
        check_user_env(env)
    assert named in str(info.value)


@pytest.mark.parametrize("env, named", [({"X": "a\x00b"}, "'X'"), ({"A=B": "1"}, "'A=B'")])
def test_the_agent_refuses_such_env_and_keeps_no_worker(tmp_path, env, named):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            info = worker("w-bad")
            info.env.update(env)
            error = await rpc_error(stub.SpawnWorkers(node_pb2.SpawnWorkersRequest(workers=[info]),
                                                      timeout=WAIT))
            assert isinstance(error, errors.InvalidArgumentError) and named in str(error)
            listed = await stub.ListWorkers(node_pb2.ListWorkersRequest(), timeout=WAIT)
            assert [w.id for w in listed.workers] == []
            await spawn_running(stub, recorder, worker("w-good"))  # still serving
    run(body())


def test_a_spawn_the_os_rejects_ends_failed_with_the_reason_and_a_retry_starts_afresh(tmp_path):
    """The exec path (no fork server): the process environment holds a NUL, so Popen raises
    ValueError. The worker ends FAILED, reported, with the reason; spawning that id again
    tries again instead of answering a ghost's pid 0."""
    reports = []

    async def body():
        spawner = Spawner(log_dir=tmp_path / "logs", node_id="n", node_address="127.0.0.1",
                          scheduler="127.0.0.1:1", token="t", report=reports.append,
                          command=[sys.executable, str(FAKE_WORKER)],
                          base_env={"PATH": os.environ.get("PATH", ""), "BAD": "a\x00b"})
        for attempt in (1, 2):
            [spawned] = await spawner.spawn([worker("w-ghost")])
            assert spawned.pid == 0
            failed = [r for r in reports if r.state == common_pb2.WORKER_FAILED]
            assert len(failed) == attempt
            assert "spawn failed: ValueError" in failed[-1].exit.reason
            [listed] = [w.to_proto() for w in spawner.workers()]
            assert listed.state == common_pb2.WORKER_FAILED and "ValueError" in listed.exit.reason
        await spawner.stop_all()
    run(body())


def test_worker_logs_are_0600_in_a_0700_folder_whatever_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        async def body():
            async with node(tmp_path) as (recorder, agent, stub):
                reply = await spawn_running(stub, recorder, worker("w-log"))
                out = reply.workers[0].log_path
                return out, out[:-len(".out")] + ".err", os.path.dirname(out)
        out, err, folder = run(body())
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(err).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700


def test_port_holds_and_stop_graces_are_bounded(tmp_path):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            for hold in (float("inf"), 1e300, limits.MAX_PORT_HOLD_SECONDS + 1):
                error = await rpc_error(stub.ReservePort(node_pb2.ReservePortRequest(hold_seconds=hold),
                                                         timeout=WAIT))
                assert isinstance(error, errors.InvalidArgumentError) and "hold_seconds" in str(error)
            assert agent.ports.held() == []
            error = await rpc_error(stub.StopWorkers(node_pb2.StopWorkersRequest(
                worker_ids=[], grace_seconds=1e300), timeout=WAIT))
            assert isinstance(error, errors.InvalidArgumentError) and "grace_seconds" in str(error)
            port = (await stub.ReservePort(node_pb2.ReservePortRequest(
                hold_seconds=limits.MAX_PORT_HOLD_SECONDS), timeout=WAIT)).port
            assert agent.ports.held() == [port]
    run(body())


def test_the_scheduler_refuses_such_env_before_any_slot_is_taken(token, arun):
    from tests.support.scheduler_fakes import Cluster

    async def scenario():
        async with Cluster(token, agents=1) as c:
            pg = await c.client.create_placement_group("pg", [{"GPU": 1}], "PACK")
            spec = common_pb2.WorkerSpec(name="w", group="g", placement_group_id=pg.id, num_gpus=1,
                                         world_size=1, env={"X": "a\x00b"})
            with pytest.raises(errors.InvalidArgumentError, match="'X'"):
                await c.client.create_workers([spec])
            assert list((await c.client.cluster_state()).workers) == []
            assert c.agents[0].spawn_requests == []
    arun(scenario())
