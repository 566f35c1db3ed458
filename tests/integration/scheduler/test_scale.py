"""Two hundred simulated 8-GPU nodes against the real scheduler service (gRPC and HTTP).

While every node heartbeats, placement groups of every shape are created and removed in
rounds and workers are spawned on some of them; then no node's lease has expired, no node
had to register twice, and every GPU is accounted exactly once: in the groups' records,
in the scheduler's capacity snapshot and on ``/v1/placement``.
"""

from __future__ import annotations

import json
import random

import aiohttp
import pytest

from podium import errors
from podium.resources import GPU_UNITS, BundleSpec
from podium.scheduler.client import SchedulerClient
from podium.scheduler.server import run_scheduler
from podium.v1 import common_pb2
from tests.support.simnodes import SimulatedNodes
from tests.support.scheduler_fakes import config
from tests.support.waiting import eventually_async

NODES = 200
GPUS = 8
LEASE = 4.0
INTERVAL = 0.5
#: (bundles, strategy): verl pools per node, wide spreads, fractions, CPU-only.
SHAPES = [([{"CPU": 1, "GPU": 1}] * 8, "STRICT_PACK"), ([{"CPU": 1, "GPU": 1}] * 4, "PACK"),
          ([{"CPU": 1, "GPU": 1}] * 16, "SPREAD"), ([{"CPU": 1, "GPU": 1 / 3}] * 3, "STRICT_PACK"),
          ([{"CPU": 2, "GPU": 0.5}] * 4, "PACK"), ([{"CPU": 1, "GPU": 1}] * 4, "STRICT_SPREAD"),
          ([{"CPU": 4}] * 2, "PACK")]


def _units_by_gpu(groups) -> dict[tuple[str, int], int]:
    """(node, GPU index) -> units the CREATED groups' records reserve there."""
    held: dict[tuple[str, int], int] = {}
    for group in groups:
        if group.state != common_pb2.PG_CREATED:
            continue
        for placed in group.placements:
            spec = BundleSpec.from_resources(dict(group.bundles[placed.bundle_index].resources))
            share = spec.gpu_units if spec.is_fractional else GPU_UNITS
            assert len(placed.gpu_indices) == spec.gpus_needed
            for index in placed.gpu_indices:
                key = (placed.node_id, index)
                held[key] = held.get(key, 0) + share
    return held


def test_two_hundred_nodes_keep_their_leases_and_every_gpu_is_accounted_once(token, arun):
    rng = random.Random(15)

    async def scenario():
        running = await run_scheduler(config(token, node_lease=LEASE, heartbeat_interval=INTERVAL))
        sim = await SimulatedNodes(running.address, token, count=NODES, gpus=GPUS, cpus=64,
                                   connections=4).start()
        client = SchedulerClient(running.address, token, timeout=30)
        try:
            await sim.wait_registered(120)
            live: list[str] = []
            made = 0
            for round_ in range(4):
                # Create until about 80% of the GPUs are asked for, then remove half.
                asked = 0
                while asked < 0.8 * NODES * GPUS:
                    bundles, strategy = rng.choice(SHAPES)
                    made += 1
                    try:
                        group = await client.create_placement_group(
                            f"g{made}", bundles, strategy, detached=True)
                    except errors.InfeasibleError:
                        continue
                    asked += sum(b.get("GPU", 0) for b in bundles)
                    if group.state == common_pb2.PG_CREATED:
                        live.append(group.id)
                    else:
                        await client.remove_placement_group(group.id)
                rng.shuffle(live)
                for group_id in live[len(live) // 2:]:
                    await client.remove_placement_group(group_id)
                del live[len(live) // 2:]
            # One worker per bundle on some whole-GPU groups: the simulated agents spawn them.
            state = await client.cluster_state()
            pools = [g for g in state.placement_groups
                     if g.state == common_pb2.PG_CREATED and len(g.bundles) == 8
                     and g.bundles[0].resources["GPU"] == 1][:20]
            worker_ids = []
            for n, group in enumerate(pools):
                specs = [common_pb2.WorkerSpec(name=f"w{n}-{r}", group=f"wg{n}", rank=r, world_size=8,
                                               placement_group_id=group.id, bundle_index=r,
                                               num_cpus=1, num_gpus=1, detached=True)
                         for r in range(8)]
                worker_ids += [w.id for w in await client.create_workers(specs)]
            await client.wait_workers(worker_ids, timeout=60)
            # Run past two leases' worth of heartbeats of every node after the churn.
            floor = {n.node_id: n.heartbeats for n in sim.nodes.values()}
            beats = int(2 * LEASE / INTERVAL)
            await eventually_async(
                lambda: all(n.heartbeats >= floor[n.node_id] + beats for n in sim.nodes.values()),
                f"{beats} more heartbeats from every node", timeout=120, interval=0.2)

            state = await client.cluster_state()
            assert len(state.nodes) == NODES
            dead = [n.info.node_id for n in state.nodes if n.state != common_pb2.NODE_ALIVE]
            assert dead == []
            assert [n.node_id for n in sim.nodes.values() if n.registrations != 1] == []
            assert sim.stats.reregister_asked == [] and sim.stats.heartbeat_failures == []
            workers = {w.id: w for w in state.workers}
            assert all(workers[i].state == common_pb2.WORKER_RUNNING for i in worker_ids)

            # Every GPU once: records, snapshot and /v1/placement agree, none over-reserved.
            held = _units_by_gpu(state.placement_groups)
            assert all(units <= GPU_UNITS for units in held.values())
            assert held, "no group was placed"
            model = running.service.model
            snapshot = {v.node_id: v for v in model.snapshot().nodes}
            assert sorted(snapshot) == sorted(sim.nodes)
            for node_id, view in snapshot.items():
                assert sorted(g.index for g in view.gpus) == list(range(GPUS))
                for gpu in view.gpus:
                    assert gpu.free_units == GPU_UNITS - held.get((node_id, gpu.index), 0)
            headers = {"Authorization": f"Bearer {token}"}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                async with http.get(f"{running.http_url}/v1/placement", headers=headers) as resp:
                    assert resp.status == 200
                    page = json.loads(await resp.text())
            uuids = [g["uuid"] for n in page["nodes"] for g in n["gpus"]]
            assert len(uuids) == NODES * GPUS == len(set(uuids))
            for node in page["nodes"]:
                for gpu in node["gpus"]:
                    units = held.get((node["node_id"], gpu["index"]), 0)
                    assert gpu["reserved_fraction"] == units / GPU_UNITS
                    assert sum(b["gpu_fraction"] for b in gpu["bundles"]) == pytest.approx(units / GPU_UNITS)
                    assert len(gpu["workers"]) <= 1  # whole-GPU workers: one per GPU
        finally:
            await client.close()
            await sim.stop()
            await running.stop(0)

    arun(scenario(), timeout=400)
