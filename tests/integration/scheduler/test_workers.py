"""The scheduler's worker path over real gRPC: placement group -> CreateWorkers ->
agent SpawnWorkers -> ReportWorker -> WaitWorkers -> GetWorkers -> RemoveWorkers."""

import asyncio

import pytest

from podium import errors
from podium.v1 import common_pb2, scheduler_pb2
from tests.support.scheduler_fakes import Cluster


def _specs(pg_id, n, group="wg", num_gpus=1.0, bundles=None, start=0, world=None, **extra):
    return [common_pb2.WorkerSpec(name=f"{group}_{start + r}", group=group, placement_group_id=pg_id,
                                  bundle_index=(bundles[r] if bundles else r), num_gpus=num_gpus,
                                  num_cpus=1, rank=start + r, world_size=world or n, **extra)
            for r in range(n)]


def test_vertical_path_spawn_wait_get_remove(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            pg = await c.client.create_placement_group("pool", [{"CPU": 1, "GPU": 1}] * 4, "STRICT_PACK")
            pg = await c.client.wait_placement_group(pg.id, timeout=5)
            assert pg.state == common_pb2.PG_CREATED
            node = pg.placements[0].node_id
            agent = next(a for a in c.agents if a.node_id == node)

            workers = await c.client.create_workers(_specs(pg.id, 4, env={"MY_VAR": "1"}))
            assert [w.spec.rank for w in workers] == [0, 1, 2, 3]
            assert len(agent.spawned) == 4 and agent.reserved
            master_port = str(agent.reserved[0])
            assert agent.spawn_requests[0].reserved_port == agent.reserved[0]
            for w in workers:
                assert w.env["MASTER_ADDR"] == agent.address
                assert w.env["MASTER_PORT"] == master_port
                assert w.env["CUDA_VISIBLE_DEVICES"] == str(w.gpu_indices[0])
                assert w.env["PODIUM_LOCAL_WORLD_SIZE"] == "4"
                assert w.env["WORLD_SIZE"] == "4" and w.env["RANK"] == str(w.spec.rank)
                assert w.env["MY_VAR"] == "1" and w.pid > 0 and w.log_path

            running = await c.client.wait_workers([w.id for w in workers], timeout=10)
            assert all(w.state == common_pb2.WORKER_RUNNING and w.port > 0 for w in running)

            by_group = await c.client.get_workers(group="wg")
            assert [w.id for w in by_group] == [w.id for w in workers]
            by_name = await c.client.get_workers(names=["wg_2"])
            assert by_name[0].id == workers[2].id

            stopped = await c.client.remove_workers([w.id for w in workers[:2]])
            assert stopped == 2 and set(agent.stopped) == {workers[0].id, workers[1].id}
            gone = await c.client.get_workers(ids=[workers[0].id])
            assert gone[0].state == common_pb2.WORKER_EXITED and gone[0].exit.requested
            # The released slots take new workers at once.
            again = await c.client.create_workers(_specs(pg.id, 2, group="wg2"))
            assert len(again) == 2
    arun(scenario())


def test_a_failed_stop_holds_the_slot_until_the_node_no_longer_runs_the_worker(token, arun):
    """A StopWorkers that fails (an agent restarting, a link down) leaves the process
    running: the worker stays STOPPING with its slot, so no replacement can be a second
    live copy of its rank; each heartbeat that still lists it asks again, and the first
    that does not ends it EXITED and frees the slot."""
    async def scenario():
        async with Cluster(token, agents=1) as c:
            [agent] = c.agents
            pg = await c.client.create_placement_group("p", [{"CPU": 1, "GPU": 1}], "PACK")
            [w] = await c.client.create_workers(_specs(pg.id, 1))
            [w] = await c.client.wait_workers([w.id], timeout=10)
            agent.fail_stop = True
            assert await c.client.remove_workers([w.id]) == 1
            [held] = await c.client.get_workers(ids=[w.id])
            assert held.state == common_pb2.WORKER_STOPPING and held.exit.requested
            with pytest.raises(errors.SlotFullError):
                await c.client.create_workers(_specs(pg.id, 1, group="again"))
            with pytest.raises(errors.AlreadyExistsError, match="still stopping on node node-a"):
                await c.client.create_workers(_specs(pg.id, 1))  # its own name is held too
            listed = scheduler_pb2.RunningWorker(worker_id=w.id, pid=w.pid, port=w.port)
            reply = await c.client.heartbeat(agent.node_id, running=[listed])
            assert list(reply.stop_worker_ids) == [w.id]
            assert (await c.client.get_workers(ids=[w.id]))[0].state == common_pb2.WORKER_STOPPING
            reply = await c.client.heartbeat(agent.node_id)  # the agent stopped it, late
            assert not reply.stop_worker_ids
            [gone] = await c.client.get_workers(ids=[w.id])
            assert gone.state == common_pb2.WORKER_EXITED and gone.exit.requested
            assert gone.exit.reason == "stopped by request"
            assert len(await c.client.create_workers(_specs(pg.id, 1, group="again"))) == 1
    arun(scenario())


def test_full_slot_is_resource_exhausted_at_once_and_reserves_nothing(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            pg = await c.client.create_placement_group("one", [{"CPU": 3, "GPU": 1}], "PACK")
            colocated = _specs(pg.id, 3, num_gpus=1 / 3, bundles=[0, 0, 0])
            workers = await c.client.create_workers(colocated)
            assert [w.env["PODIUM_LOCAL_WORLD_SIZE"] for w in workers] == ["3"] * 3
            spawned = sum(len(a.spawned) for a in c.agents)
            extra = _specs(pg.id, 1, group="other", num_gpus=1 / 3, bundles=[0])
            with pytest.raises(errors.SlotFullError, match="full"):
                # A full slot fails at once; it never waits for capacity.
                await asyncio.wait_for(c.client.create_workers(extra), 5.0)
            assert sum(len(a.spawned) for a in c.agents) == spawned
            state = await c.client.cluster_state()
            assert len(state.workers) == 3
    arun(scenario())


def test_dead_worker_fails_the_wait_with_its_exit(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            for agent in c.agents:
                agent.auto_run = False
            pg = await c.client.create_placement_group("p", [{"CPU": 1, "GPU": 1}], "PACK")
            [w] = await c.client.create_workers(_specs(pg.id, 1))
            await c.client.report_worker(w.id, common_pb2.WORKER_FAILED, node_id=w.node_id,
                                         exit=common_pb2.ExitInfo(exit_code=3, stderr_tail="boom",
                                                                  reason="exited with code 3"))
            with pytest.raises(errors.WorkerDiedError) as info:
                await c.client.wait_workers([w.id], timeout=5)
            assert info.value.exit_code == 3 and "boom" in info.value.stderr_tail
    arun(scenario())


def test_wait_workers_deadline_names_the_pending_workers(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            for agent in c.agents:
                agent.auto_run = False
            pg = await c.client.create_placement_group("p", [{"CPU": 1, "GPU": 1}], "PACK")
            [w] = await c.client.create_workers(_specs(pg.id, 1))
            with pytest.raises(errors.DeadlineExceededError, match="wg_0"):
                await c.client.wait_workers([w.id], timeout=0.2)
    arun(scenario())


def test_spawn_failure_releases_the_slots_and_names_the_node(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            pg = await c.client.create_placement_group("p", [{"CPU": 1, "GPU": 1}] * 2, "STRICT_SPREAD")
            bad = next(a for a in c.agents if a.node_id == pg.placements[1].node_id)
            bad.fail_spawn = True
            with pytest.raises(errors.UnavailableError, match=bad.node_id):
                await c.client.create_workers(_specs(pg.id, 2))
            state = await c.client.cluster_state()
            assert all(w.state == common_pb2.WORKER_FAILED for w in state.workers)
            bad.fail_spawn = False
            workers = await c.client.create_workers(_specs(pg.id, 2))
            assert len(workers) == 2
    arun(scenario())


def test_removing_the_group_stops_its_workers(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            pg = await c.client.create_placement_group("p", [{"CPU": 1, "GPU": 1}] * 2, "STRICT_SPREAD")
            workers = await c.client.create_workers(_specs(pg.id, 2))
            assert await c.client.remove_placement_group(pg.id) == 2
            stopped = {i for a in c.agents for i in a.stopped}
            assert stopped == {w.id for w in workers}
    arun(scenario())


def test_master_from_an_earlier_call_of_the_same_group(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            pg1 = await c.client.create_placement_group("p1", [{"CPU": 1, "GPU": 1}] * 2, "STRICT_PACK")
            pg2 = await c.client.create_placement_group("p2", [{"CPU": 1, "GPU": 1}] * 2, "STRICT_PACK")
            first = await c.client.create_workers(_specs(pg1.id, 2, world=4))
            second = await c.client.create_workers(_specs(pg2.id, 2, start=2, world=4), master_rank=0)
            assert {w.env["MASTER_PORT"] for w in first + second} == {first[0].env["MASTER_PORT"]}
            assert {w.env["MASTER_ADDR"] for w in first + second} == {first[0].node_address}
    arun(scenario())


def test_master_port_failure_names_the_node_and_reserves_nothing(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            pg = await c.client.create_placement_group("p", [{"CPU": 1, "GPU": 1}], "PACK")
            master = next(a for a in c.agents if a.node_id == pg.placements[0].node_id)
            master.fail_reserve = True
            with pytest.raises(errors.UnavailableError, match=f"MASTER_PORT on node {master.node_id}"):
                await c.client.create_workers(_specs(pg.id, 1))
            assert not (await c.client.cluster_state()).workers and not master.spawned
    arun(scenario())


def test_wait_workers_follows_each_report_and_a_death_after_running_fails_it(token, arun):
    """WaitWorkers looks only at the workers each commit changed: two waits in flight (the
    whole group and a part of it) each answer once their last worker runs, whatever the
    order of the reports; a worker that ran and then died fails a wait still waiting for
    others at once, with its exit."""
    async def scenario():
        async with Cluster(token, agents=1, gpus=8) as c:
            [agent] = c.agents
            agent.auto_run = False
            pg = await c.client.create_placement_group("p", [{"CPU": 2, "GPU": 1}] * 8, "PACK")
            workers = await c.client.create_workers(_specs(pg.id, 8, num_gpus=0.5))
            ids = [w.id for w in workers]
            whole = asyncio.ensure_future(c.client.wait_workers(ids, timeout=60))
            part = asyncio.ensure_future(c.client.wait_workers(ids[5:], timeout=60))
            for i in (7, 0, 5, 3, 6, 1, 4):
                await c.client.report_worker(ids[i], common_pb2.WORKER_RUNNING, node_id=agent.node_id,
                                             pid=100 + i, port=9000 + i)
            assert [w.id for w in await asyncio.wait_for(part, 30)] == ids[5:]
            await c.client.get_workers(ids=ids)  # one more round trip: rank 2 still starts
            assert not whole.done()
            await c.client.report_worker(ids[2], common_pb2.WORKER_RUNNING, node_id=agent.node_id,
                                         pid=102, port=9002)
            running = await asyncio.wait_for(whole, 30)
            assert all(w.state == common_pb2.WORKER_RUNNING for w in running)

            more = await c.client.create_workers(_specs(pg.id, 4, group="wg2", num_gpus=0.5,
                                                        bundles=[0, 1, 2, 3]))
            more_ids = [w.id for w in more]
            wait = asyncio.ensure_future(c.client.wait_workers(more_ids, timeout=60))
            await c.client.report_worker(more_ids[0], common_pb2.WORKER_RUNNING, node_id=agent.node_id,
                                         pid=200, port=9100)
            await c.client.report_worker(more_ids[0], common_pb2.WORKER_FAILED, node_id=agent.node_id,
                                         exit=common_pb2.ExitInfo(exit_code=5, stderr_tail="late crash",
                                                                  reason="exited with code 5"))
            with pytest.raises(errors.WorkerDiedError) as info:
                await asyncio.wait_for(wait, 30)
            assert info.value.exit_code == 5 and "late crash" in info.value.stderr_tail
    arun(scenario())


def test_assign_workers_hands_a_standby_a_dead_ranks_place(token, arun):
    """A WorkerGroup's standby that took over rank 1 is recorded in the group with rank 1
    (what `podium status`, the dashboard and an attach by group read); a rank a live worker
    holds, a bad rank, a rank given twice or an ended worker is refused and changes nothing."""
    async def scenario():
        async with Cluster(token, agents=1) as c:
            pg = await c.client.create_placement_group("p", [{"CPU": 1, "GPU": 1}] * 3, "PACK")
            ranks = await c.client.create_workers(_specs(pg.id, 2))
            [spare] = await c.client.create_workers(_specs(pg.id, 1, group="wg.standby", bundles=[2]))
            await c.client.wait_workers([w.id for w in [*ranks, spare]], timeout=10)
            with pytest.raises(errors.FailedPreconditionError, match="held by live worker 'wg_1'"):
                await c.client.assign_workers([(spare.id, "wg", 1, 2)])
            with pytest.raises(errors.InvalidArgumentError, match=r"rank = 2 must be in \[0, world_size=2\)"):
                await c.client.assign_workers([(spare.id, "wg", 2, 2)])
            with pytest.raises(errors.InvalidArgumentError, match="group is required"):
                await c.client.assign_workers([(spare.id, "", 0, 1)])
            [still] = await c.client.get_workers(group="wg.standby")
            assert (still.id, still.spec.group, still.spec.rank) == (spare.id, "wg.standby", 0)

            await c.client.remove_workers([ranks[1].id])
            with pytest.raises(errors.InvalidArgumentError, match="assigned twice"):
                await c.client.assign_workers([(spare.id, "wg", 1, 2), (ranks[0].id, "wg", 1, 2)])
            [moved] = await c.client.assign_workers([(spare.id, "wg", 1, 2)])
            assert (moved.spec.group, moved.spec.rank, moved.spec.world_size) == ("wg", 1, 2)
            group = await c.client.get_workers(group="wg")
            assert [(w.id, w.spec.rank) for w in group] == [(ranks[0].id, 0), (spare.id, 1)]
            assert await c.client.get_workers(group="wg.standby") == []
            with pytest.raises(errors.FailedPreconditionError, match="WORKER_EXITED: only a live worker"):
                await c.client.assign_workers([(ranks[1].id, "other", 0, 1)])
    arun(scenario())
