"""Under `podium run`: ray.util.collective between the two workers of a verl RayWorkerGroup
(the calls verl's NCCL checkpoint engine makes), on gloo where there is no CUDA; the
rendezvous goes through a named Podium actor."""

import ray
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
)
from verl_workers import Peer

ray.init()
pool = RayResourcePool([2], use_gpu=True, max_colocate_count=1)
wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(Peer)))
results = wg.collective("weights")
for rank, out in enumerate(results):
    assert out["broadcast"] == [2.0] * 4, out      # rank 1's tensor
    assert out["sum"] == 3.0 and out["gathered"] == [0.0, 1.0], out
    assert out["rank"] == rank and out["size"] == 2 and out["after"] is False, out
assert wg.collective("again")[0]["sum"] == 3.0     # a second group, after the first was destroyed
ray.shutdown()
print("SCENARIO OK")
