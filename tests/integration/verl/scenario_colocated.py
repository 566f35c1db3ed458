"""Under `podium run`: verl's ResourcePoolManager makes the pool; verl's
create_colocated_worker_cls puts Counter and Doubler in one process per rank and spawn()
gives a group per role; create_colocated_worker_cls_fused + spawn (spawn_fused) the same."""

import ray
import torch
from verl import DataProto
from verl.single_controller.ray import (
                                        RayClassWithInitArgs,
                                        RayWorkerGroup,
                                        ResourcePoolManager,
                                        create_colocated_worker_cls,
)
from verl.single_controller.ray.base import create_colocated_worker_cls_fused
from verl_workers import Counter, Doubler

ray.init()
manager = ResourcePoolManager(resource_pool_spec={"global_pool": [2]}, mapping={"counter": "global_pool"},
                              max_colocate_count=2)
manager.create_resource_pool()  # checks the GPUs with ray._private.state.available_resources_per_node()
pool = manager.get_resource_pool("counter")
assert manager.get_n_gpus() == 2

roles = {"counter": RayClassWithInitArgs(cls=ray.remote(Counter), start=5),
         "doubler": RayClassWithInitArgs(cls=ray.remote(Doubler))}
colocated = RayWorkerGroup(pool, create_colocated_worker_cls(roles))
groups = colocated.spawn(prefix_set=roles.keys())
assert groups["counter"].add(1) == [6, 7]
assert groups["doubler"].twice(4) == [8, 8]
data = DataProto.from_dict({"x": torch.arange(4)})
assert groups["doubler"].plus_one(data).batch["x"].tolist() == [1, 2, 3, 4]
pids = {tuple(g.env("PODIUM_WORKER_ID")) for g in (groups["counter"],)}
assert len(pids) == 1 and colocated.world_size == 2  # one process per rank holds both roles

fused_roles = {"counter": RayClassWithInitArgs(cls=ray.remote(Counter), start=100),
               "doubler": RayClassWithInitArgs(cls=ray.remote(Doubler))}
fused = RayWorkerGroup(pool, create_colocated_worker_cls_fused(fused_roles))
fused_groups = fused.spawn(prefix_set=fused_roles.keys())   # spawn_fused: reads raw_cls_dict
assert fused_groups["counter"].add(1) == [101, 102]
assert fused_groups["doubler"].twice(21) == [42, 42]
ray.shutdown()
print("SCENARIO OK")
