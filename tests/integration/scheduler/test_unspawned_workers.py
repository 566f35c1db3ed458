"""Issue #14, item 4: a scheduler that dies between committing a worker STARTING and its
spawn does not leak the slot: after the restart, a worker no agent reports is FAILED with
the reason within the restore grace, and its bundle takes a new worker."""

from __future__ import annotations

import asyncio
import time

import pytest

from podium import errors
from podium.scheduler.client import SchedulerClient
from podium.scheduler.server import run_scheduler
from podium.v1 import common_pb2
from tests.support.scheduler_fakes import FakeAgent, config

pytestmark = pytest.mark.faults


class PausedAgent(FakeAgent):
    """Receives SpawnWorkers and never answers while ``paused`` (a SIGSTOPped agent)."""

    paused = True

    async def SpawnWorkers(self, request, context):
        self.spawn_requests.append(request)
        while self.paused:
            await asyncio.sleep(0.05)
        return await super().SpawnWorkers(request, context)


def _spec(pg_id, name):
    return common_pb2.WorkerSpec(name=name, group=name, placement_group_id=pg_id, num_gpus=1, world_size=1,
                                 detached=True)


def test_a_worker_committed_but_never_spawned_is_failed_after_a_restart_and_its_slot_freed(
        token, arun, tmp_path):
    state = str(tmp_path / "state.db")

    async def scenario():
        running = await run_scheduler(config(token, state=state, restore_grace=0.5))
        agent = await PausedAgent(node_id="n1", address="127.0.0.2", token=token,
                                  scheduler=running.address).start()
        try:
            async with SchedulerClient(running.address, token, timeout=60) as client:
                await client.register_node(agent.info(gpus=1))
                pg = await client.create_placement_group("one", [{"GPU": 1}], "PACK", detached=True)
                create = asyncio.ensure_future(client.create_workers([_spec(pg.id, "first")]))
                while not agent.spawn_requests:
                    await asyncio.sleep(0.02)
                await running.stop(0)  # the scheduler dies while the spawn is pending
                with pytest.raises(errors.PodiumError):
                    await create
            running = await run_scheduler(config(token, state=state, restore_grace=0.5))
            agent.scheduler = running.address
            agent.paused = False
            restarted = time.monotonic()
            async with SchedulerClient(running.address, token) as client:
                [stuck] = (await client.cluster_state()).workers
                assert stuck.state == common_pb2.WORKER_STARTING and stuck.pid == 0
                await client.register_node(agent.info(gpus=1))  # lists no running worker
                for _ in range(400):
                    [worker] = (await client.cluster_state()).workers
                    if worker.state != common_pb2.WORKER_STARTING:
                        break
                    await asyncio.sleep(0.05)
                print(f"\nunspawned worker resolved {time.monotonic() - restarted:.2f} s after the "
                      f"restart (restore grace 0.5 s)")
                assert worker.state == common_pb2.WORKER_FAILED
                assert "never spawned" in worker.exit.reason
                [again] = await client.create_workers([_spec(pg.id, "second")])
                assert again.state in (common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING)
        finally:
            agent.paused = False
            await agent.stop()
            await running.stop(0)
    arun(scenario(), timeout=120)
