"""Weight sync into the vLLM rollout: colocated in one process, and across processes in buckets."""

from __future__ import annotations

import pytest

from tests.support.rollout_kit import make_sync_actor_cls, prompt_batch, vllm_marks

pytestmark = [*vllm_marks, pytest.mark.timeout(300)]

FORCED = 11
PROMPTS = [[1, 4, 5], [1, 6]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from podium.rollout.recipes.tinymodel import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=2)


@pytest.fixture(scope="module")
def cluster():
    import podium

    podium.init()
    yield
    podium.shutdown()


def _rollout_cfg(model_dir):
    return dict(model_path=model_dir, n=2, max_tokens=5, max_model_len=32, kv_cache_memory_bytes=4 << 20)


def test_colocated_actor_hands_its_state_dict_in_process(cluster, model_dir):
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup, create_colocated_worker_cls
    from podium.rollout.vllm import VLLMRollout

    cls = create_colocated_worker_cls({"actor": ClassWithInitArgs(make_sync_actor_cls(), model_dir),
                                       "rollout": ClassWithInitArgs(VLLMRollout, _rollout_cfg(model_dir))})
    wg = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), cls, name_prefix="colo")
    try:
        roles = wg.spawn({"actor", "rollout"})
        actor, rollout = roles["actor"], roles["rollout"]
        actor.init_model()
        rollout.init_model()
        before = rollout.generate_sequences(prompt_batch(PROMPTS))
        assert not (before.batch["responses"] == FORCED).all()
        actor.force(FORCED)  # the actor's weights change in its own process only
        stats = rollout.update_weights(source="actor")
        assert [s["fetch_s"] for s in stats] == [0.0, 0.0]  # nothing fetched: the sibling's tensors
        out = rollout.generate_sequences(prompt_batch(PROMPTS))
        assert (out.batch["responses"] == FORCED).all()
        # The actor and the engine live in the same worker process on each rank.
        assert actor.pid() == [info["pid"] for info in rollout.engine_info()]
        assert rollout.sleep() == [False, False] and rollout.wake_up() == [False, False]  # CPU: no-ops
    finally:
        wg.shutdown()


def test_cross_process_sync_goes_in_buckets_over_the_data_path(cluster, model_dir):
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.errors import InvalidArgumentError
    from podium.rollout.sync import push_weights
    from podium.rollout.vllm import VLLMRollout

    actor = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1),
                        ClassWithInitArgs(make_sync_actor_cls(), model_dir), name_prefix="actor")
    rollout = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1),
                          ClassWithInitArgs(VLLMRollout, _rollout_cfg(model_dir)), name_prefix="rollout")
    try:
        actor.init_model()
        rollout.init_model()
        actor.force(FORCED)
        with pytest.raises(InvalidArgumentError, match="bucket_bytes"):
            push_weights(actor, rollout, bucket_bytes=1)
        # 64 KiB buckets: the tiny model (~0.3 MB) travels in several of them.
        result = push_weights(actor, rollout, bucket_bytes=64 << 10)
        assert result["buckets"] > 2 and result["bytes"] > 0
        out = rollout.generate_sequences(prompt_batch(PROMPTS))
        assert (out.batch["responses"] == FORCED).all()
    finally:
        actor.shutdown()
        rollout.shutdown()
