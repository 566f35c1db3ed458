"""The rollout package's pure parts (no vLLM needed): config bounds, weight checks,
bucket plans, GRPO advantages and reward."""

from __future__ import annotations

import pytest
import torch

from podium.dataproto import DataProto
from podium.errors import InvalidArgumentError
from podium.rollout.config import RolloutConfig
from podium.rollout.recipes.grpo import group_advantages, target_token_reward
from podium.rollout.weights import check_weights, plan_buckets, sibling_state_dict


def _cfg(**over):
    return RolloutConfig.from_value(dict(dict(model_path="/m", kv_cache_memory_bytes=1 << 20), **over))


@pytest.mark.parametrize("field,value", [("n", 0), ("n", 257), ("n", True), ("max_tokens", 0),
                                         ("max_tokens", 200), ("kv_cache_memory_bytes", 0),
                                         ("temperature", -1.0), ("top_p", 0.0), ("top_k", 0),
                                         ("dtype", "int8"), ("seed", -1), ("bucket_bytes", 10),
                                         ("model_path", "")])
def test_config_refuses_out_of_bounds(field, value):
    with pytest.raises(InvalidArgumentError, match=field):
        _cfg(**{field: value})


def test_config_needs_the_kv_budget_and_known_fields():
    with pytest.raises(TypeError):
        RolloutConfig(model_path="/m")  # kv_cache_memory_bytes has no default on purpose
    with pytest.raises(InvalidArgumentError, match="unknown field"):
        RolloutConfig.from_value({"model_path": "/m", "kv_cache_memory_bytes": 1, "gpu_memory_utilization": 0.9})
    assert _cfg(n=4).n == 4


def test_check_weights_names_unknown_and_misshapen():
    expected = {"a.weight": (2, 3), "b.bias": (3,)}
    items = check_weights({"a.weight": torch.ones(2, 3, requires_grad=True)}.items(), expected, complete=False)
    assert items[0][0] == "a.weight" and not items[0][1].requires_grad
    with pytest.raises(InvalidArgumentError, match=r"does not have: \['c'\]"):
        check_weights({"c": torch.ones(1)}.items(), expected, complete=False)
    with pytest.raises(InvalidArgumentError, match=r"b.bias: got \(4,\), model has \(3,\)"):
        check_weights({"b.bias": torch.ones(4)}.items(), expected, complete=False)
    with pytest.raises(InvalidArgumentError, match=r"1 name\(s\) missing.*b.bias"):
        check_weights({"a.weight": torch.ones(2, 3)}.items(), expected)
    assert len(check_weights({"a.weight": torch.ones(2, 3), "b.bias": torch.ones(3)}.items(), expected)) == 2
    with pytest.raises(InvalidArgumentError, match="no weights"):
        check_weights({}.items(), expected)
    with pytest.raises(InvalidArgumentError, match="pairs"):
        check_weights({"a.weight": [1, 2]}.items(), expected)


def test_plan_buckets_bounds_each_bucket():
    state = {f"t{i}": torch.zeros(256) for i in range(10)}  # 1 KiB each
    plan = plan_buckets(state, 3 << 10)
    assert plan == [["t0", "t1", "t2"], ["t3", "t4", "t5"], ["t6", "t7", "t8"], ["t9"]]
    assert plan_buckets({"big": torch.zeros(4096)}, 1 << 10) == [["big"]]  # too big travels alone
    with pytest.raises(InvalidArgumentError):
        plan_buckets(state, 0)


def test_sibling_lookup_says_what_is_colocated():
    class Holder:
        fused_worker_dict = {"critic": object()}

    with pytest.raises(InvalidArgumentError, match=r"no role 'actor'.*\['critic'\]"):
        sibling_state_dict(Holder(), "actor")
    with pytest.raises(InvalidArgumentError, match="offers no weights"):
        sibling_state_dict(Holder(), "critic")


def test_group_advantages_and_target_reward():
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5])
    adv = group_advantages(rewards, 2)
    assert adv[0] < 0 < adv[1] and adv[2:].abs().max() < 1e-6
    with pytest.raises(InvalidArgumentError):
        group_advantages(rewards, 3)
    batch = DataProto.from_dict(tensors={"responses": torch.tensor([[7, 7, 0], [7, 3, 3]]),
                                         "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])})
    assert target_token_reward(batch, 7).tolist() == pytest.approx([1.0, 1 / 3])


def test_colocated_roles_see_their_siblings(monkeypatch):
    """A WorkerDict gives every role the shared role dict: the rollout finds the actor."""
    from podium.worker import Worker
    from podium.controller.group.colocate import create_colocated_worker_cls
    from podium.worker.factory import ClassWithInitArgs

    # Worker.__init__ writes these back to os.environ: monkeypatch restores them all after.
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "REDIS_STORE_SERVER_HOST"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(key, value)

    class Actor(Worker):
        def rollout_state_dict(self):
            return {"w": torch.ones(2)}

    class Rollout(Worker):
        pass

    obj = create_colocated_worker_cls({"actor": ClassWithInitArgs(Actor),
                                       "rollout": ClassWithInitArgs(Rollout)}).cls()
    rollout = obj.worker_dict["rollout"]
    assert rollout.get_fused_worker_by_name("actor") is obj.worker_dict["actor"]
    assert sibling_state_dict(rollout, "actor")["w"].tolist() == [1.0, 1.0]
