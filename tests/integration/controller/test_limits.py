"""Issue #14, items 3 and 11: every count and duration a client sets is bounded, and the
scheduler's leases measure the peers' silence, not the scheduler's own stalls."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

from podium import errors, limits
from podium.scheduler import core
from podium.scheduler.service import INLINE_BUNDLES
from podium.v1 import common_pb2, scheduler_pb2
from tests.support.scheduler_fakes import Cluster, node_info

SMALL = {"CPU": 0.001}


def test_a_placement_group_over_the_bundle_bound_is_refused_and_nothing_is_stored(token, arun):
    async def scenario():
        async with Cluster(token, agents=0) as c:
            await c.client.register_node(node_info("big", "127.0.0.2", 7001, gpus=0, cpus=2000))
            request = scheduler_pb2.CreatePlacementGroupRequest(name="huge", strategy=common_pb2.PACK)
            for _ in range(limits.MAX_BUNDLES + 1):
                request.bundles.add(resources=SMALL)
            started = time.perf_counter()
            with pytest.raises(errors.InvalidArgumentError, match="bundles: 10001 entries") as info:
                await c.client.call("CreatePlacementGroup", request)
            print(f"\n10,001 bundles refused in {1000 * (time.perf_counter() - started):.1f} ms")
            assert "limit of 10000" in str(info.value)
            state = await c.client.cluster_state()
            assert list(state.placement_groups) == []
            # The bound itself is accepted.
            group = await c.client.create_placement_group("fits", [SMALL] * limits.MAX_BUNDLES, "PACK")
            assert group.state == common_pb2.PG_CREATED
    arun(scenario(), timeout=120)


@pytest.mark.parametrize("build, field", [
    (lambda: scheduler_pb2.WaitWorkersRequest(ids=["w"] * (limits.MAX_REPEATED + 1)), "ids"),
    (lambda: scheduler_pb2.HeartbeatRequest(node_id="n", running=[
        scheduler_pb2.RunningWorker(worker_id="w")] * (limits.MAX_REPEATED + 1)), "running"),
    (lambda: scheduler_pb2.CreateWorkersRequest(specs=[common_pb2.WorkerSpec(
        name="a", env={f"K{i}": "v" for i in range(limits.MAX_MAP_ENTRIES + 1)})]), "specs[0].env"),
], ids=["ids", "running", "env"])
def test_every_list_and_map_in_a_request_is_bounded(token, arun, build, field):
    async def scenario():
        async with Cluster(token, agents=0) as c:
            request = build()
            method = type(request).__name__.removesuffix("Request")
            with pytest.raises(errors.InvalidArgumentError, match=re.escape(f"{field}: ")):
                await c.client.call(method, request)
            assert (await c.client.cluster_state()).scheduler_id  # still serving
    arun(scenario())


@pytest.mark.parametrize("lease", [float("inf"), 1e300, limits.MAX_SESSION_LEASE_SECONDS + 1, -1])
def test_a_session_lease_beyond_the_bound_is_refused(token, arun, lease):
    async def scenario():
        async with Cluster(token, agents=0) as c:
            with pytest.raises(errors.InvalidArgumentError, match="lease_seconds"):
                await c.client.open_session("x", lease_seconds=lease)
            assert (await c.client.cluster_state()).scheduler_id
            assert (await c.client.open_session("ok", lease_seconds=limits.MAX_SESSION_LEASE_SECONDS))
    arun(scenario())


def test_remove_workers_grace_is_bounded(token, arun):
    async def scenario():
        async with Cluster(token, agents=0) as c:
            for grace in (float("inf"), 1e300, limits.MAX_GRACE_SECONDS + 1):
                with pytest.raises(errors.InvalidArgumentError, match="grace_seconds"):  # the server
                    await c.client.call("RemoveWorkers", scheduler_pb2.RemoveWorkersRequest(
                        ids=["w-x"], grace_seconds=grace))
                with pytest.raises(errors.InvalidArgumentError, match="grace_seconds"):  # the SDK
                    await c.client.remove_workers(["w-x"], grace_seconds=grace)
    arun(scenario())


def test_a_scheduler_stall_longer_than_the_node_lease_kills_no_node(token, arun):
    """The event loop blocked for 2.5 s (a node lease is 1 s): the node that heartbeat just
    before stays ALIVE, and its next heartbeat is an ordinary one."""
    async def scenario():
        async with Cluster(token, agents=0, node_lease=1.0, heartbeat_interval=0.2) as c:
            await c.client.register_node(node_info("n1", "127.0.0.2", 7001))
            await c.client.heartbeat("n1")
            asyncio.get_running_loop().call_soon(time.sleep, 2.5)  # the scheduler's loop stalls
            await asyncio.sleep(0.4)  # two lease checks after the stall
            state = await c.client.cluster_state()
            assert [common_pb2.NodeState.Name(n.state) for n in state.nodes] == ["NODE_ALIVE"]
            assert not (await c.client.heartbeat("n1")).reregister
            # A node that really stays silent still expires after the stall.
            async def dead():
                nodes = (await c.client.cluster_state()).nodes
                return nodes[0].state == common_pb2.NODE_DEAD
            for _ in range(200):
                if await dead():
                    break
                await asyncio.sleep(0.05)
            assert await dead()
    arun(scenario())


def test_placement_runs_off_the_loop_so_heartbeats_are_served_meanwhile(token, arun, monkeypatch):
    """A slow placement (stand-in: core.place made to take 2 s) does not hold the loop that
    answers heartbeats: a heartbeat sent while it runs is answered before it ends. Only a
    large group can be slow to place (one of a few bundles takes microseconds and is placed
    on the loop, INLINE_BUNDLES), so the stand-in has one bundle more than that."""
    entered, release = threading.Event(), threading.Event()
    real_place = core.place

    def slow_place(request, snapshot):
        entered.set()
        release.wait(5)
        return real_place(request, snapshot)

    monkeypatch.setattr(core, "place", slow_place)

    async def scenario():
        async with Cluster(token, agents=0) as c:
            await c.client.register_node(node_info("n1", "127.0.0.2", 7001))
            create = asyncio.ensure_future(c.client.create_placement_group(
                "slow", [SMALL] * (INLINE_BUNDLES + 1), "PACK"))
            for _ in range(500):
                if entered.is_set():
                    break
                await asyncio.sleep(0.01)
            assert entered.is_set()
            beat = await c.client.heartbeat("n1")
            assert not beat.reregister
            assert not create.done(), "the heartbeat waited for the placement"
            release.set()
            assert (await create).state == common_pb2.PG_CREATED
    try:
        arun(scenario())
    finally:
        release.set()
