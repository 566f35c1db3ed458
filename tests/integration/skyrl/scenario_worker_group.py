"""SkyRL's ``PPORayActorGroup`` builds a worker group of SkyRL's ``Worker`` on a placement
group (resources=None, SkyRL's master address and port from rank 0, a gloo process group of
4 ranks with sequence parallel 2), then SkyRL's dispatch runs over it: ``MeshDispatch``
through ``async_run_ray_method("mesh", ...)`` (``ray.put`` chunks as arguments),
``concatenate_outputs_after_mesh_dispatch``, ``stage_chunks``/``dispatch_from_staged`` and
``PassThroughDispatch``. Run under ``podium run --num-cpus 16 --num-gpus 4``."""

from __future__ import annotations

import ray
import torch
from ray.util.placement_group import placement_group

from skyrl.backends.skyrl_train.distributed.dispatch import (
    DispatchRegistry,
    MeshDispatch,
    PassThroughDispatch,
    concatenate_outputs_after_mesh_dispatch,
)
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.backends.skyrl_train.workers.worker import PPORayActorGroup
from skyrl.train.config import AlgorithmConfig, TrainerConfig
from skyrl.train.utils.utils import ResolvedPlacementGroup
from skyrl_workers import CpuWorker

ray.init()
cfg = TrainerConfig(algorithm=AlgorithmConfig(temperature=1.0))
pg = placement_group([{"GPU": 1, "CPU": 1}] * 4, strategy="PACK")
ray.get(pg.ready())
group = PPORayActorGroup(cfg, num_nodes=1, num_gpus_per_node=4, ray_actor_type=ray.remote(num_gpus=1)(CpuWorker),
                         pg=ResolvedPlacementGroup(pg), num_gpus_per_actor=0.2, sequence_parallel_size=2)
assert [info.rank.dp for info in group.actor_infos] == [0, 0, 1, 1], group.actor_infos
assert [info.rank.sp for info in group.actor_infos] == [0, 1, 0, 1]
assert group.get_dp_size() == 2
where = ray.get([actor.where.remote() for actor in group._actor_handlers])
assert [w["rank"] for w in where] == [0, 1, 2, 3] and all(w["initialized"] for w in where), where
assert len({w["master"] for w in where}) == 1 and where[0]["master"][0] == where[0]["node_ip"], where
assert [w["env_rank"] for w in where] == ["0", "1", "2", "3"] and {w["world_size"] for w in where} == {"4"}
ray.get(group.async_init_model("model-path", lr=1e-6))

data = TrainingInputBatch({"a": torch.arange(8)})
assert DispatchRegistry.get("mesh") is MeshDispatch and DispatchRegistry.get("pass_through") is PassThroughDispatch
refs = group.async_run_ray_method("mesh", "forward", data=data)
outputs = ray.get(refs)
assert {o.metadata["world"] for o in outputs} == {4}
merged = concatenate_outputs_after_mesh_dispatch(group.actor_infos, outputs)
# dp rank 0 (global rank 0) got rows 0-3, dp rank 1 (global rank 2) rows 4-7.
assert merged["a"].tolist() == [0, 1, 2, 3, 204, 205, 206, 207], merged["a"]

staged = MeshDispatch.stage_chunks(2, data, [(0, 4), (4, 8)])
second = ray.get(MeshDispatch.dispatch_from_staged(group.actor_infos, "forward", staged[1]))
assert concatenate_outputs_after_mesh_dispatch(group.actor_infos, second)["a"].tolist() == [4, 5, 206, 207]
ranks = ray.get(group.async_run_ray_method("pass_through", "get_mesh_rank"))
assert [r.dp for r in ranks] == [0, 0, 1, 1]
print("SCENARIO OK")
