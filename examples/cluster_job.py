"""Run a WorkerGroup on a running Podium cluster: the `job` service of docker-compose.yml.

    docker compose up -d                 # scheduler + two node agents
    docker compose run --rm job          # this script, in a container on the cluster network

or from any machine that reaches the scheduler:

    PODIUM_ADDRESS=127.0.0.1:50051 PODIUM_TOKEN=... python examples/cluster_job.py

It reserves one placement group per entry of ``PODIUM_JOB_PROCESS_ON_NODES`` (default
"4,4": four GPUs on each of two nodes), starts one worker per GPU, and then, as a training
job would: asks every rank where it runs, all-reduces across ranks with torch.distributed
(gloo, initialised from the RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT Podium sets), and
splits a batch over the ranks with DP_COMPUTE_PROTO. The last line it prints is one JSON
object (ranks, nodes, checks), which tests/cluster/test_compose.py reads.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch

from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium import init, shutdown
from podium.dataproto import DataProto
from podium.worker import Dispatch, Worker, register


class ProbeWorker(Worker):
    """A stand-in for a training role: reports its placement, joins a process group, computes."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self) -> dict:
        """Where this rank runs and which GPU it was given."""
        return {"rank": self.rank, "world_size": self.world_size,
                "node": os.environ.get("PODIUM_NODE_ADDRESS", ""), "hostname": socket.gethostname(),
                "cuda_visible_devices": self.get_cuda_visible_devices(),
                "master": ":".join(self.get_master_addr_port())}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_ranks(self) -> int:
        """Sum of every rank over a gloo process group spanning all nodes."""
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo")  # every variable it needs comes from Podium
        value = torch.tensor([self.rank])
        dist.all_reduce(value)
        return int(value.item())

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def score(self, data: DataProto) -> DataProto:
        """A per-shard computation: doubles x and stamps the rank that did it."""
        data.batch["score"] = data.batch["x"] * 2
        data.batch["rank"] = torch.full_like(data.batch["x"], self.rank)
        data.batch["payload_sum"] = data.batch["payload"].sum(dim=1)
        return data


def main() -> int:
    """Run the job; exit 0 when every check holds."""
    address = os.environ.get("PODIUM_ADDRESS")
    if not address:
        print("set PODIUM_ADDRESS=host:port of the scheduler (and PODIUM_TOKEN)", file=sys.stderr)
        return 2
    counts = [int(n) for n in os.environ.get("PODIUM_JOB_PROCESS_ON_NODES", "4,4").split(",")]
    init(address=address)
    try:
        pool = ResourcePool(process_on_nodes=counts, use_gpu=True, max_colocate_count=1)
        wg = WorkerGroup(resource_pool=pool, ray_cls_with_init=ClassWithInitArgs(ProbeWorker))
        world = wg.world_size
        ranks = wg.where()
        for info in ranks:
            print(f"rank {info['rank']}/{info['world_size']} on {info['node']} "
                  f"(CUDA_VISIBLE_DEVICES={info['cuda_visible_devices']})", flush=True)
        sums = wg.all_reduce_ranks()
        # 1 MiB of payload per shard each way: large enough for the same-host
        # shared-memory path where controller and workers share a host.
        rows = 4 * world
        batch = DataProto.from_dict({"x": torch.arange(rows),
                                     "payload": torch.arange(rows * 65536, dtype=torch.float64
                                                             ).reshape(rows, 65536) % 7})
        out = wg.score(batch)
        checks = {
            "ranks_in_order": [info["rank"] for info in ranks] == list(range(world)),
            "all_reduce": sums == [world * (world - 1) // 2] * world,
            "score": torch.equal(out.batch["score"], batch.batch["x"] * 2),
            "payload": torch.equal(out.batch["payload"], batch.batch["payload"])
            and torch.equal(out.batch["payload_sum"], batch.batch["payload"].sum(dim=1)),
            "every_rank_scored": sorted(set(out.batch["rank"].tolist())) == list(range(world)),
        }
        nodes = sorted({info["node"] for info in ranks})
        print(json.dumps({"world_size": world, "nodes": nodes, "ranks": ranks, "checks": checks}),
              flush=True)
        return 0 if all(checks.values()) else 1
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
