"""A SkyRL worker the scenarios' worker groups build: SkyRL's own ``Worker`` (its
``DistributedTorchRayActor`` constructor: master address from
``ray._private.services.get_node_ip_address``, free port, RANK/WORLD_SIZE), with the two
methods a CPU cannot run as SkyRL wrote them replaced: the process group is gloo and the
device mesh is on ``cpu`` (SkyRL's is ``cuda``), and there is no model to load."""

from __future__ import annotations

import os
from datetime import timedelta

import ray
import torch

from skyrl.backends.skyrl_train.distributed.dispatch import MeshRank
from skyrl.backends.skyrl_train.training_batch import TrainingOutputBatch
from skyrl.backends.skyrl_train.workers.worker import Worker


class CpuWorker(Worker):
    """SkyRL's Worker on a CPU."""

    def init_worker_process_group(self) -> None:
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(backend="gloo", timeout=timedelta(seconds=120))
        dp_size = self._world_size // self.sequence_parallel_size
        self.device_mesh = torch.distributed.device_mesh.init_device_mesh(
            "cpu", mesh_shape=(dp_size, self.sequence_parallel_size), mesh_dim_names=("dp", "sp"))
        self.mesh_rank = MeshRank(dp=self.device_mesh.get_local_rank(mesh_dim="dp"),
                                  sp=self.device_mesh.get_local_rank(mesh_dim="sp"), tp=0, pp=0,
                                  world_size=self._world_size, dp_size=self.device_mesh.size(0), pp_size=1)

    def init_model(self, *args, **kwargs) -> None:
        self.initialized_with = (args, kwargs)

    def forward(self, data) -> TrainingOutputBatch:
        """Each rank answers its chunk plus 100 x its global rank, summed over the group with
        gloo first (so every rank really is in one process group)."""
        world = torch.tensor([1.0])
        torch.distributed.all_reduce(world)
        out = TrainingOutputBatch({"a": data["a"] + 100 * self._rank + 0 * world})
        out.metadata = {"world": int(world.item())}
        return out

    def where(self) -> dict:
        return {"rank": self._rank, "master": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
                "node_ip": ray._private.services.get_node_ip_address(), "initialized": ray.is_initialized(),
                "world_size": os.environ["WORLD_SIZE"], "env_rank": os.environ["RANK"]}
