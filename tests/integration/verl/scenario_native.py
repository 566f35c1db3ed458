"""Under `podium run --native-verl`: verl's `verl.single_controller.ray` is Podium's own
WorkerGroup. verl's Worker subclass (verl's @register, a class wrapped by @ray.remote), every
dispatch mode with verl's padding rule, blocking=False, Execute.RANK_ZERO, verl's DataProto
in and out as verl's type, and verl's ResourcePoolManager names, all on Podium's groups."""

import ray
import torch
import verl.single_controller.ray as verl_ray
from verl import DataProto
from verl.protocol import DataProtoConfig
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolManager,
)
from verl.single_controller.ray.base import split_resource_pool
from verl_workers import Counter

import podium.controller

assert getattr(ray, "__podium__", False), ray
assert getattr(verl_ray, "__podium__", False), verl_ray
assert RayWorkerGroup is podium.controller.RayWorkerGroup and RayResourcePool is podium.controller.RayResourcePool
assert split_resource_pool is podium.controller.split_resource_pool
try:
    verl_ray.sort_placement_group_by_node_ip
except NotImplementedError as exc:  # a name native mode does not give says so, naming the way out
    assert "--native-verl" in str(exc), exc
else:
    raise AssertionError("an unknown name of verl.single_controller.ray resolved")

ray.init()
pool = RayResourcePool([2], use_gpu=True, max_colocate_count=1)
wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(Counter), start=10))
assert wg.world_size == 2 and type(wg).__module__.startswith("podium."), type(wg)

assert wg.add(1) == [11, 12]                                      # ONE_TO_ALL
assert wg.pair([5, 6]) == [(0, 5), (1, 6)]                         # ALL_TO_ALL
assert wg.square([[1, 2], [3]]) == [[1, 4], [9]]                   # DP_COMPUTE
data = DataProto.from_dict({"x": torch.arange(6)})
out = wg.double(data)                                              # DP_COMPUTE_PROTO
assert type(out) is DataProto, type(out)                           # verl's own type comes back
assert out.batch["x"].tolist() == [0, 2, 4, 6, 8, 10] and out.batch["rank"].tolist() == [0, 0, 0, 1, 1, 1]
odd = DataProto.from_dict({"x": torch.arange(5)}, meta_info={DataProtoConfig.auto_padding_key: True})
padded = wg.double(odd)                                            # padded to 6, trimmed back to 5
assert padded.batch["x"].tolist() == [0, 2, 4, 6, 8], padded.batch["x"]
try:
    wg.double(DataProto.from_dict({"x": torch.arange(5)}))         # no padding asked: verl's error
except AssertionError as exc:  # verl's own DataProto.chunk rule and message
    assert "only support equal chunk" in str(exc), exc
else:
    raise AssertionError("5 rows split over 2 ranks without padding")
assert wg.apply(lambda t: t + 1, data).batch["x"].tolist() == [1, 2, 3, 4, 5, 6]  # DP_COMPUTE_PROTO_WITH_FUNC
assert wg.metric(data) == [{"rank": 0, "sum": 3}, {"rank": 1, "sum": 12}]          # DP_COMPUTE_METRIC
wg.join_mesh()
assert wg.by_mesh(data).batch["x"].tolist() == list(range(6))     # make_nd_compute_dataproto_dispatch_fn
assert wg.only_zero() == 0                                         # Execute.RANK_ZERO
later = wg.later(3)                                                # blocking=False: refs ray.get takes
assert ray.get(later) == [3, 4]
assert wg.ray_module() == [True, True]                             # the workers' `import ray` is Podium
assert wg.env("RANK") == ["0", "1"] and wg.env("WORLD_SIZE") == ["2", "2"]

# verl's ResourcePoolManager shape, from the native module
manager = ResourcePoolManager(resource_pool_spec={"global_pool": [1]}, mapping={"counter": "global_pool"})
manager.create_resource_pool()
assert manager.get_n_gpus() == 1
solo = RayWorkerGroup(manager.get_resource_pool("counter"), RayClassWithInitArgs(cls=ray.remote(Counter)))
assert solo.add(0) == [0]
solo.shutdown()
wg.shutdown()
ray.shutdown()
print("SCENARIO OK")
