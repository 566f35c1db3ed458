"""Cross-node weight sync: an actor on 127.0.0.2 and a vLLM rollout on 127.0.0.3.

The buckets go from the actor's worker to the rollout's worker over Podium's data path
(the two nodes are separate agents, so no shared-memory shortcut between them is assumed).
"""

from __future__ import annotations

import os

import pytest

from tests.support.clusters import controller_cluster
from tests.support.rollout_kit import make_sync_actor_cls, prompt_batch, vllm_marks

pytestmark = [pytest.mark.cluster, *vllm_marks, pytest.mark.timeout(300)]

FORCED = 13


def test_weights_cross_two_nodes_in_buckets(tmp_path):
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.rollout.sync import push_weights
    from podium.rollout.recipes.tinymodel import build_tiny_llama
    from podium.rollout.vllm import VLLMRollout

    model_dir = build_tiny_llama(tmp_path / "tiny", seed=4)
    cfg = dict(model_path=model_dir, n=2, max_tokens=4, max_model_len=32, kv_cache_memory_bytes=4 << 20)
    # One fake GPU per node and one GPU per group: the two groups land on different nodes.
    (tmp_path / "cluster").mkdir()
    with controller_cluster("two_nodes", tmp_path / "cluster", gpus_per_node=1):
        actor = WorkerGroup(ResourcePool([1], use_gpu=True, max_colocate_count=1),
                            ClassWithInitArgs(make_sync_actor_cls(), model_dir), name_prefix="actor")
        rollout = WorkerGroup(ResourcePool([1], use_gpu=True, max_colocate_count=1),
                              ClassWithInitArgs(VLLMRollout, cfg), name_prefix="rollout")
        try:
            nodes = {g.execute_rank_zero_sync("execute_func_rank_zero", os.getenv, "PODIUM_NODE_ADDRESS")
                     for g in (actor, rollout)}
            assert nodes == {"127.0.0.2", "127.0.0.3"}
            actor.init_model()
            rollout.init_model()
            actor.force(FORCED)
            result = push_weights(actor, rollout, bucket_bytes=128 << 10)
            assert result["buckets"] > 1
            out = rollout.generate_sequences(prompt_batch([[1, 4, 5], [1, 7]]))
            assert (out.batch["responses"] == FORCED).all()
        finally:
            actor.shutdown()
            rollout.shutdown()

