"""Under `podium run`: verl's RayWorkerGroup of Counter workers, every dispatch mode,
blocking=False, Execute.RANK_ZERO, the stand-in in the workers, verl's parallel_put and the
ray._private.state / state-api reads verl's RayResourcePool and aliveness check make."""

import ray
import torch
from verl import DataProto
from verl.protocol import DataProtoConfig
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
)
from verl.utils.ray_utils import parallel_put
from verl_workers import Counter

assert getattr(ray, "__podium__", False), ray
ray.init()
pool = RayResourcePool([2], use_gpu=True, max_colocate_count=1)
wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(Counter), start=10))
assert wg.world_size == 2

assert wg.add(1) == [11, 12]                                      # ONE_TO_ALL
assert wg.pair([5, 6]) == [(0, 5), (1, 6)]                         # ALL_TO_ALL
assert wg.square([[1, 2], [3]]) == [[1, 4], [9]]                   # DP_COMPUTE
data = DataProto.from_dict({"x": torch.arange(6)})
out = wg.double(data)                                              # DP_COMPUTE_PROTO
assert out.batch["x"].tolist() == [0, 2, 4, 6, 8, 10] and out.batch["rank"].tolist() == [0, 0, 0, 1, 1, 1]
odd = DataProto.from_dict({"x": torch.arange(5)}, meta_info={DataProtoConfig.auto_padding_key: True})
padded = wg.double(odd)                                            # padded to 6, trimmed back to 5
assert padded.batch["x"].tolist() == [0, 2, 4, 6, 8], padded.batch["x"]
assert wg.apply(lambda t: t + 1, data).batch["x"].tolist() == [1, 2, 3, 4, 5, 6]  # DP_COMPUTE_PROTO_WITH_FUNC
assert wg.metric(data) == [{"rank": 0, "sum": 3}, {"rank": 1, "sum": 12}]          # DP_COMPUTE_METRIC
wg.join_mesh()
assert wg.by_mesh(data).batch["x"].tolist() == list(range(6))     # make_nd_compute_dataproto_dispatch_fn
assert wg.only_zero() == 0                                         # Execute.RANK_ZERO
later = wg.later(3)                                                # blocking=False: refs
assert ray.get(later) == [3, 4]
assert wg.ray_module() == [True, True]                             # the workers' `import ray` is Podium
assert wg.env("RANK") == ["0", "1"] and wg.env("WORLD_SIZE") == ["2", "2"]
assert wg.env("MASTER_PORT")[0] == wg.env("MASTER_PORT")[1] == wg.master_port

# verl.utils.ray_utils.parallel_put: refs that come back whole from ray.get and as call arguments
refs = parallel_put([torch.arange(3), {"a": 1}, "text"], max_workers=2)
assert [type(v).__name__ for v in ray.get(refs)] == ["Tensor", "dict", "str"]

# what RayResourcePool and the aliveness check read
from ray._private.state import available_resources_per_node, state
from ray.experimental.state.api import get_actor
from ray.util import placement_group_table

pg = pool.pgs[0]
table = state.placement_group_table(pg.id)
assert table["state"] == "CREATED" and sorted(table["bundles_to_node_id"]) == [0, 1], table
assert set(table["bundles_to_node_id"].values()) <= {n["NodeID"] for n in ray.nodes()}
assert pg.id in placement_group_table()
free = available_resources_per_node()
assert sum(r["GPU"] for r in free.values()) == ray.cluster_resources()["GPU"] - 2, free
assert all(wg._is_worker_alive(w) for w in wg.workers)
assert get_actor(wg.workers[0]._actor_id.hex())["state"] == "ALIVE"
ray.kill(wg.workers[1])
assert not wg._is_worker_alive(wg.workers[1])
ray.shutdown()
print("SCENARIO OK")
