"""Persistence: a scheduler restarted on the same state file finds everything again."""

import pytest

from podium import errors
from podium.scheduler.client import SchedulerClient
from podium.scheduler.server import run_scheduler
from podium.v1 import common_pb2
from tests.support.scheduler_fakes import FakeAgent, config


def test_restart_on_the_same_state_file_keeps_sessions_groups_and_workers(token, arun, tmp_path):
    state = str(tmp_path / "state.db")

    async def scenario():
        running = await run_scheduler(config(token, state=state))
        agent = await FakeAgent(node_id="n1", address="127.0.0.2", token=token,
                                scheduler=running.address).start()
        try:
            async with SchedulerClient(running.address, token) as client:
                await client.register_node(agent.info(gpus=2))
                session = await client.open_session("keeps", lease_seconds=60)
                pg = await client.create_placement_group("pg", [{"GPU": 1}] * 2, "PACK",
                                                         owner=session.session_id)
                [w] = await client.create_workers([common_pb2.WorkerSpec(
                    name="w", group="g", placement_group_id=pg.id, num_gpus=1, world_size=1)],
                    owner=session.session_id)
                removed = await client.create_placement_group("gone", [{"CPU": 1}], "PACK")
                await client.remove_placement_group(removed.id)
                before = await client.cluster_state()
            await running.stop(0)

            running = await run_scheduler(config(token, state=state))
            agent.scheduler = running.address
            async with SchedulerClient(running.address, token) as client:
                after = await client.cluster_state()
                # Message equality (map fields serialize in no fixed order).
                assert list(after.placement_groups) == list(before.placement_groups)
                assert list(after.workers) == list(before.workers)
                assert await client.keep_alive(session.session_id)
                closed = await client.close_session(session.session_id)
                assert (closed.removed_placement_groups, closed.removed_workers) == (1, 1)
                assert w.id in agent.stopped
        finally:
            await agent.stop()
            await running.stop(0)
    arun(scenario())


def test_memory_state_starts_empty_each_time(token, arun):
    async def scenario():
        for _ in range(2):
            running = await run_scheduler(config(token))
            try:
                async with SchedulerClient(running.address, token) as client:
                    assert not (await client.cluster_state()).nodes
                    await client.register_node(common_pb2.NodeInfo(
                        node_id="n", address="127.0.0.2", agent_port=9, cpus=1))
            finally:
                await running.stop(0)
    arun(scenario())


def test_a_state_file_serves_one_scheduler_at_a_time(token, arun, tmp_path):
    state = str(tmp_path / "state.db")

    async def scenario():
        first = await run_scheduler(config(token, state=state))
        try:
            with pytest.raises(errors.FailedPreconditionError, match="in use"):
                await run_scheduler(config(token, state=state))
        finally:
            await first.stop(0)
        second = await run_scheduler(config(token, state=state))
        await second.stop(0)
    arun(scenario())
