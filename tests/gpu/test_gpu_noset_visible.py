"""RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES on real GPUs, as slime and SkyRL set it: an
actor of a fraction of one GPU sees every GPU of its node through CUDA, and
``ray.get_gpu_ids()`` still names the one it was given; without it, it sees only that one."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


class Probe:
    """What CUDA and Ray's view of the GPUs say inside the actor."""

    def sees(self) -> dict:
        import torch as t

        import podium.compat.ray as ray_there
        return {"count": t.cuda.device_count(), "ids": ray_there.get_gpu_ids(),
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


def test_noset_actor_sees_every_gpu_and_knows_its_own(gpu_cluster):
    import podium.compat.ray as ray

    noset = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    wide = ray.remote(Probe).options(num_gpus=0.2, runtime_env=noset).remote()
    narrow = ray.remote(Probe).options(num_gpus=0.2).remote()
    wide_seen, narrow_seen = ray.get([wide.sees.remote(), narrow.sees.remote()])
    expected = torch.cuda.device_count()  # the node's GPUs as this process (the agent's parent) sees them
    assert wide_seen["count"] == expected, wide_seen
    assert wide_seen["visible"] == os.environ.get("CUDA_VISIBLE_DEVICES"), wide_seen
    assert len(wide_seen["ids"]) == 1 and 0 <= wide_seen["ids"][0] < gpu_cluster.gpus, wide_seen
    assert narrow_seen["count"] == 1 and narrow_seen["ids"] == [int(narrow_seen["visible"])], narrow_seen
    ray.kill(wide)
    ray.kill(narrow)
