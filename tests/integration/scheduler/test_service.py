"""The scheduler over real gRPC and HTTP: nodes, leases, placement groups, auth, bad input, metrics."""

import asyncio
import json
import math

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from podium import errors
from podium.scheduler.client import SchedulerClient
from podium.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.support.scheduler_fakes import Cluster, node_info

ONE_GPU = {"CPU": 1, "GPU": 1}


async def _until(predicate, timeout=10.0):
    """Poll ``predicate`` (an async callable) until true; fail after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def _get(url, token=None, method="GET"):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.request(method, url, headers=headers) as resp:
            return resp.status, await resp.text()


def test_registration_heartbeat_and_lease_expiry(token, arun):
    async def scenario():
        async with Cluster(token, agents=0, node_lease=0.3, heartbeat_interval=0.1) as c:
            reply = await c.client.register_node(node_info("n1", "127.0.0.2", 7001))
            assert reply.lease_seconds == 0.3 and reply.heartbeat_interval_seconds == 0.1
            assert reply.scheduler_id == c.running.service.scheduler_id
            await c.client.register_node(node_info("n2", "127.0.0.3", 7002))
            beat = await c.client.heartbeat("n1", gpus=[common_pb2.GpuInfo(index=0, memory_used_bytes=123)])
            assert not beat.reregister
            state = await c.client.cluster_state()
            assert {n.info.node_id for n in state.nodes} == {"n1", "n2"}
            n1 = next(n for n in state.nodes if n.info.node_id == "n1")
            assert n1.info.gpus[0].memory_used_bytes == 123

            pg = await c.client.create_placement_group("on-n2", [ONE_GPU] * 4, "STRICT_PACK")

            async def n2_dead():
                await c.client.heartbeat("n1")   # n1 keeps its lease
                nodes = {n.info.node_id: n.state for n in (await c.client.cluster_state()).nodes}
                return nodes["n2"] == common_pb2.NODE_DEAD and nodes["n1"] == common_pb2.NODE_ALIVE
            await _until(n2_dead)
            if pg.placements[0].node_id == "n2":
                gone = await c.client.get_placement_group(pg.id)
                assert gone.state == common_pb2.PG_REMOVED and gone.reason == "node n2 died"
            assert (await c.client.heartbeat("n2")).reregister
            assert (await c.client.heartbeat("unknown")).reregister
            await c.client.register_node(node_info("n2", "127.0.0.3", 7002))
            assert not (await c.client.heartbeat("n2")).reregister
    arun(scenario())


def test_strict_pack_and_spread_over_two_nodes(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            pack = await c.client.create_placement_group("pack", [ONE_GPU] * 3, "STRICT_PACK")
            spread = await c.client.create_placement_group("spread", [ONE_GPU] * 2, "SPREAD")
            assert pack.state == spread.state == common_pb2.PG_CREATED
            assert len({p.node_id for p in pack.placements}) == 1
            assert {p.node_id for p in spread.placements} == {"node-a", "node-b"}
            assert sorted(p.node_address for p in spread.placements) == ["127.0.0.2", "127.0.0.3"]
            by_name = await c.client.get_placement_group(name="pack")
            assert by_name.id == pack.id
            with pytest.raises(errors.AlreadyExistsError, match="pack"):
                await c.client.create_placement_group("pack", [ONE_GPU], "PACK")
    arun(scenario())


def test_infeasible_at_once_and_pending_until_removal(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            with pytest.raises(errors.InfeasibleError) as info:
                await c.client.create_placement_group("huge", [ONE_GPU] * 5, "STRICT_PACK")
            assert set(info.value.node_reasons) == {"node-a", "node-b"}
            a = await c.client.create_placement_group("a", [ONE_GPU] * 4, "STRICT_PACK")
            b = await c.client.create_placement_group("b", [ONE_GPU] * 4, "STRICT_PACK")
            c3 = await c.client.create_placement_group("c", [ONE_GPU] * 4, "STRICT_PACK")
            assert c3.state == common_pb2.PG_PENDING and c3.reason
            with pytest.raises(errors.DeadlineExceededError, match="'c' still PENDING after"):
                await c.client.wait_placement_group(c3.id, timeout=0.2)
            waiter = asyncio.ensure_future(c.client.wait_placement_group(c3.id, timeout=10))
            await asyncio.sleep(0.05)
            assert not waiter.done()
            await c.client.remove_placement_group(a.id)
            created = await waiter
            assert created.state == common_pb2.PG_CREATED
            assert {p.node_id for p in created.placements} == {p.node_id for p in a.placements}
            assert b.state == common_pb2.PG_CREATED
    arun(scenario())


def test_sessions_own_what_they_create(token, arun):
    async def scenario():
        async with Cluster(token, session_lease=0.3) as c:
            session = await c.client.open_session("test script")
            assert session.lease_seconds == 0.3
            owned = await c.client.create_placement_group("owned", [ONE_GPU], "PACK",
                                                          owner=session.session_id)
            kept = await c.client.create_placement_group("kept", [ONE_GPU], "PACK", detached=True,
                                                         owner=session.session_id)
            assert await c.client.keep_alive(session.session_id)

            async def expired():
                return (await c.client.get_placement_group(owned.id)).state == common_pb2.PG_REMOVED
            await _until(expired)
            assert (await c.client.get_placement_group(kept.id)).state == common_pb2.PG_CREATED
            assert not await c.client.keep_alive(session.session_id)

            other = await c.client.open_session("second", lease_seconds=60)
            await c.client.create_placement_group("x", [ONE_GPU], "PACK", owner=other.session_id)
            closed = await c.client.close_session(other.session_id)
            assert closed.removed_placement_groups == 1
    arun(scenario())


# Each bad request: (RPC, request, error class, text the message must name).
BAD_REQUESTS = [
    ("CreatePlacementGroup", scheduler_pb2.CreatePlacementGroupRequest(
        name="g", strategy=1), errors.InvalidSpecError, "at least one bundle"),
    ("CreatePlacementGroup", scheduler_pb2.CreatePlacementGroupRequest(
        name="g", strategy=1, bundles=[common_pb2.Bundle(resources={"GPU": -2})]),
     errors.InvalidSpecError, "-2"),
    ("CreatePlacementGroup", scheduler_pb2.CreatePlacementGroupRequest(
        name="g", strategy=1, bundles=[common_pb2.Bundle(resources={"CPU": math.nan})]),
     errors.InvalidSpecError, "nan"),
    ("CreatePlacementGroup", scheduler_pb2.CreatePlacementGroupRequest(
        name="g", strategy=7, bundles=[common_pb2.Bundle(resources={"GPU": 1})]),
     errors.InvalidSpecError, "7"),
    ("CreatePlacementGroup", scheduler_pb2.CreatePlacementGroupRequest(
        name="g", strategy=1, bundles=[common_pb2.Bundle(resources={"GPU": 1.5})]),
     errors.InvalidSpecError, "1.5"),
    ("CreatePlacementGroup", scheduler_pb2.CreatePlacementGroupRequest(
        strategy=1, bundles=[common_pb2.Bundle(resources={"GPU": 1})]),
     errors.InvalidArgumentError, "name"),
    ("GetPlacementGroup", scheduler_pb2.GetPlacementGroupRequest(id="pg-missing"),
     errors.NotFoundError, "pg-missing"),
    ("WaitPlacementGroup", scheduler_pb2.WaitPlacementGroupRequest(id="pg-missing"),
     errors.NotFoundError, "pg-missing"),
    ("RemovePlacementGroup", scheduler_pb2.RemovePlacementGroupRequest(id="pg-missing"),
     errors.NotFoundError, "pg-missing"),
    ("GetWorkers", scheduler_pb2.GetWorkersRequest(ids=["w-missing"]), errors.NotFoundError,
     "w-missing"),
    ("WaitWorkers", scheduler_pb2.WaitWorkersRequest(ids=["w-missing"]), errors.NotFoundError,
     "w-missing"),
    ("RemoveWorkers", scheduler_pb2.RemoveWorkersRequest(ids=["w-missing"]), errors.NotFoundError,
     "w-missing"),
    ("ReportWorker", scheduler_pb2.ReportWorkerRequest(worker_id="w-missing"), errors.NotFoundError,
     "w-missing"),
    ("CloseSession", scheduler_pb2.CloseSessionRequest(session_id="s-missing"), errors.NotFoundError,
     "s-missing"),
    ("OpenSession", scheduler_pb2.OpenSessionRequest(lease_seconds=-1), errors.InvalidArgumentError,
     "-1"),
    ("RegisterNode", scheduler_pb2.RegisterNodeRequest(node=common_pb2.NodeInfo(
        node_id="n", address="127.0.0.9", agent_port=0)), errors.InvalidArgumentError, "agent_port"),
    ("CreateWorkers", scheduler_pb2.CreateWorkersRequest(specs=[common_pb2.WorkerSpec(
        name="w", group="g", placement_group_id="pg-missing", world_size=1)]),
     errors.NotFoundError, "pg-missing"),
    ("CreateWorkers", scheduler_pb2.CreateWorkersRequest(), errors.InvalidArgumentError,
     "at least one"),
]


@pytest.mark.parametrize("method,request_,cls,text", BAD_REQUESTS,
                         ids=[f"{m}-{i}" for i, (m, *_) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_the_right_status_and_change_nothing(token, arun, method, request_, cls, text):
    async def scenario():
        async with Cluster(token) as c:
            before = (await c.client.cluster_state()).SerializeToString()
            with pytest.raises(cls, match=text) as info:
                await c.client.call(method, request_)
            assert type(info.value) is cls
            after = await c.client.cluster_state()
            after.ClearField("scheduler_id")
            before_msg = scheduler_pb2.ClusterState.FromString(before)
            before_msg.ClearField("scheduler_id")
            # Heartbeat times do not move without heartbeats: the state is byte-identical.
            assert after == before_msg
    arun(scenario())


def test_bad_worker_spec_over_the_wire(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            pg = await c.client.create_placement_group("p", [ONE_GPU], "PACK")
            spec = common_pb2.WorkerSpec(name="w", group="g", placement_group_id=pg.id,
                                         num_gpus=1.5, world_size=1)
            with pytest.raises(errors.InvalidSpecError, match="1.5"):
                await c.client.create_workers([spec])
            spec.num_gpus = 1
            spec.env["CUDA_VISIBLE_DEVICES"] = "3"
            with pytest.raises(errors.InvalidSpecError, match="CUDA_VISIBLE_DEVICES"):
                await c.client.create_workers([spec])
            assert not (await c.client.cluster_state()).workers
            assert not any(a.spawned or a.reserved for a in c.agents)
    arun(scenario())


def test_token_missing_or_wrong_is_unauthenticated_and_changes_nothing(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            for bad in ("wrong-token", ""):
                async with SchedulerClient(c.running.address, bad) as intruder:
                    with pytest.raises(errors.AuthenticationError):
                        await intruder.create_placement_group("evil", [ONE_GPU], "PACK")
            channel = grpc.aio.insecure_channel(c.running.address)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await scheduler_pb2_grpc.SchedulerStub(channel).GetClusterState(
                        scheduler_pb2.GetClusterStateRequest(), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            finally:
                await channel.close()
            assert not (await c.client.cluster_state()).placement_groups

            base = c.running.http_url
            for path in ("/v1/nodes", "/v1/placement", "/v1/workers", "/metrics"):
                assert (await _get(base + path))[0] == 401
                assert (await _get(base + path, "wrong"))[0] == 401
                assert (await _get(base + path, token))[0] == 200
            status, body = await _get(base + "/v1/nodes", "wrong")
            assert "error" in json.loads(body)
    arun(scenario())


def test_http_endpoints(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            base = c.running.http_url
            assert await _get(base + "/healthz") == (200, "ok")
            assert (await _get(base + "/readyz"))[0] == 200
            status, body = await _get(base + "/nope", token)
            assert status == 404 and "nope" in json.loads(body)["error"]
            status, body = await _get(base + "/v1/nodes", token, method="POST")
            assert status == 405 and "POST" in json.loads(body)["error"]

            pg = await c.client.create_placement_group("frac", [{"CPU": 2, "GPU": 1}], "PACK")
            specs = [common_pb2.WorkerSpec(name=f"w{r}", group="g", placement_group_id=pg.id,
                                           num_gpus=1 / 2, num_cpus=1, rank=r, world_size=2)
                     for r in range(2)]
            workers = await c.client.wait_workers(
                [w.id for w in await c.client.create_workers(specs)], timeout=5)
            node_id = workers[0].node_id
            gpu = workers[0].gpu_indices[0]
            uuid = f"GPU-{node_id}-{gpu}"
            await c.client.heartbeat(
                node_id, gpus=[common_pb2.GpuInfo(index=gpu, memory_used_bytes=5000)],
                processes=[common_pb2.ProcessMemory(pid=workers[0].pid, gpu_uuid=uuid, used_bytes=3000),
                           common_pb2.ProcessMemory(pid=workers[1].pid, gpu_uuid=uuid, used_bytes=2000)])

            status, body = await _get(base + "/v1/placement", token)
            assert status == 200
            doc = json.loads(body)
            node = next(n for n in doc["nodes"] if n["node_id"] == node_id)
            entry = next(g for g in node["gpus"] if g["index"] == gpu)
            assert entry["uuid"] == uuid and entry["memory_used_bytes"] == 5000
            assert entry["bundles"] == [{"placement_group_id": pg.id, "placement_group": "frac",
                                         "bundle_index": 0, "gpu_fraction": 1.0,
                                         "gpu_fraction_text": "1"}]
            assert [(w["name"], w["gpu_fraction"], w["gpu_fraction_text"], w["memory_used_bytes"])
                    for w in entry["workers"]] == [("w0", 0.5, "1/2", 3000), ("w1", 0.5, "1/2", 2000)]
            [group] = doc["placement_groups"]
            assert group["name"] == "frac" and group["bundles"][0]["node_id"] == node_id

            status, body = await _get(base + "/v1/workers", token)
            assert {w["id"] for w in json.loads(body)["workers"]} == {w.id for w in workers}
            status, body = await _get(base + "/v1/nodes", token)
            assert {n["info"]["node_id"] for n in json.loads(body)["nodes"]} == {"node-a", "node-b"}

            status, text = await _get(base + "/metrics", token)
            families = {f.name: f for f in text_string_to_metric_families(text)}
            nodes = {s.labels["state"]: s.value for s in families["podium_scheduler_nodes"].samples}
            assert nodes["NODE_ALIVE"] == 2
            groups = {s.labels["state"]: s.value
                      for s in families["podium_scheduler_placement_groups"].samples}
            assert groups["PG_CREATED"] == 1
            rpcs = {(s.labels["method"], s.labels["code"]): s.value
                    for s in families["podium_scheduler_rpcs"].samples if s.name.endswith("_total")}
            assert rpcs[("CreatePlacementGroup", "OK")] == 1
            assert "podium_scheduler_rpc_seconds" in families
    arun(scenario())


def test_rpc_errors_are_counted_by_code(token, arun):
    async def scenario():
        async with Cluster(token, agents=0) as c:
            with pytest.raises(errors.NotFoundError):
                await c.client.get_placement_group("pg-missing")
            status, text = await _get(c.running.http_url + "/metrics", token)
            samples = [s for f in text_string_to_metric_families(text) for s in f.samples
                       if s.name == "podium_scheduler_rpcs_total"]
            assert any(s.labels == {"method": "GetPlacementGroup", "code": "NOT_FOUND"} and s.value == 1
                       for s in samples)
    arun(scenario())
