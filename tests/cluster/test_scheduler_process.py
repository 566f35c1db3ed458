"""The real ``podium scheduler`` process: serve, show /v1/placement, survive SIGKILL."""

import asyncio
import json
import signal
import urllib.request

import pytest

from podium import errors
from podium.scheduler.client import SchedulerClient
from podium.v1 import common_pb2, scheduler_pb2
from tests.support.scheduler_fakes import FakeAgent

pytestmark = pytest.mark.cluster

ONE_GPU = {"CPU": 1, "GPU": 1}


def _http_json(url: str, token: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def _comparable(state: scheduler_pb2.ClusterState) -> scheduler_pb2.ClusterState:
    """The state minus what a restart legitimately changes (incarnation id, lease clocks)."""
    out = scheduler_pb2.ClusterState()
    out.CopyFrom(state)
    out.ClearField("scheduler_id")
    for node in out.nodes:
        node.ClearField("last_heartbeat")
    return out


def test_restart_after_sigkill_restores_groups_workers_and_slots(scheduler_process, token, tmp_path, arun):
    async def scenario():
        first = scheduler_process(tmp_path / "state.db")
        agents = [await FakeAgent(node_id=f"node-{x}", address=f"127.0.0.{2 + i}", token=token,
                                  scheduler=first.address).start() for i, x in enumerate("ab")]
        try:
            async with SchedulerClient(first.address, token, timeout=10) as client:
                for agent in agents:
                    await client.register_node(agent.info(gpus=4))
                pack = await client.create_placement_group("pack", [ONE_GPU] * 4, "STRICT_PACK")
                spread = await client.create_placement_group("spread", [{"CPU": 2, "GPU": 1}] * 2,
                                                             "SPREAD", detached=True)
                specs = [common_pb2.WorkerSpec(name=f"actor_{r}", group="actor",
                                               placement_group_id=spread.id, bundle_index=r,
                                               num_gpus=0.5, num_cpus=1, rank=r, world_size=2)
                         for r in range(2)]
                workers = await client.create_workers(specs)
                await client.wait_workers([w.id for w in workers], timeout=10)
                pending = await client.create_placement_group("later", [ONE_GPU] * 4, "STRICT_PACK")
                assert pending.state == common_pb2.PG_PENDING
                before = await client.cluster_state()

            doc = await asyncio.to_thread(_http_json, first.http_url + "/v1/placement", token)
            nodes = {n["node_id"]: n for n in doc["nodes"]}
            assert set(nodes) == {"node-a", "node-b"}
            pack_node = pack.placements[0].node_id
            owned = [g for g in nodes[pack_node]["gpus"]
                     if any(b["placement_group"] == "pack" for b in g["bundles"])]
            assert len(owned) == 4
            actors = [(w["name"], w["gpu_fraction_text"]) for n in nodes.values()
                      for g in n["gpus"] for w in g["workers"]]
            assert sorted(actors) == [("actor_0", "1/2"), ("actor_1", "1/2")]
            assert {g["name"]: g["state"] for g in doc["placement_groups"]} == {
                "pack": "PG_CREATED", "spread": "PG_CREATED", "later": "PG_PENDING"}

            assert first.kill(signal.SIGKILL) == -signal.SIGKILL
            second = scheduler_process(tmp_path / "state.db")
            async with SchedulerClient(second.address, token, timeout=10) as client:
                after = await client.cluster_state()
                assert after.scheduler_id != before.scheduler_id
                assert _comparable(after) == _comparable(before)
                for old, new in zip(before.workers, after.workers):
                    assert (new.id, new.state, new.pid, new.port, dict(new.env)) == \
                        (old.id, old.state, old.pid, old.port, dict(old.env))
                # Restored nodes got a fresh lease and heartbeat without re-registering.
                for agent in agents:
                    assert not (await client.heartbeat(agent.node_id)).reregister
                assert (await client.heartbeat("node-zz")).reregister
                # Slots are still taken: each actor bundle holds 1 GPU, 0.5 of it in use.
                more = common_pb2.WorkerSpec(name="extra", group="critic", placement_group_id=spread.id,
                                             bundle_index=0, num_gpus=0.75, num_cpus=1, world_size=1)
                with pytest.raises(errors.SlotFullError):
                    await client.create_workers([more])
                # Reservations are still taken: the pending group waits until "pack" goes.
                assert (await client.get_placement_group(name="later")).state == common_pb2.PG_PENDING
                await client.remove_placement_group(pack.id)
                later = await client.wait_placement_group(pending.id, timeout=10)
                assert later.state == common_pb2.PG_CREATED
            assert second.kill(signal.SIGTERM) == 0
        finally:
            for agent in agents:
                await agent.stop()
    arun(scenario(), timeout=120)
