"""verl's own RayWorkerGroup, unmodified, on Podium: run it with

    tools/install-verl.sh && . .venv-verl/bin/activate && podium run -- python examples/verl_ray_mode.py

`import ray` below is Podium's stand-in (podium run puts it first on the path for this process
and every worker); the verl classes are the wheel's own. Without podium run, in a notebook:
``import podium.compat; podium.compat.activate()`` before ``import ray``.
"""

import ray
import torch
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
)


class Scorer(Worker):
    """Adds its rank to each row's score."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def score(self, data: DataProto) -> DataProto:
        data.batch["score"] += self.rank
        return data


if __name__ == "__main__":
    ray.init()  # the embedded cluster (fake GPUs on a CPU machine); PODIUM_ADDRESS joins one
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=True, max_colocate_count=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(Scorer)))
    out = wg.score(DataProto.from_dict({"score": torch.zeros(4)}))
    print("scores:", out.batch["score"].tolist(), "| ray is Podium:", getattr(ray, "__podium__", False))
    ray.shutdown()
