"""The vLLM rollout role on the embedded cluster: generation, weight sync, bad input.

Real worker processes host real vLLM engines (CPU, in-process, float32) over a tiny random
Llama built offline. Skipped, naming vLLM, where it is not installed.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.rollout_kit import forcing_state_dict, original_state_dict, prompt_batch, vllm_marks

pytestmark = [*vllm_marks, pytest.mark.timeout(300)]

N, MAX_TOKENS, MAX_LEN = 3, 6, 32
FORCED = 9  # a plain word's id


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from podium.rollout.recipes.tinymodel import build_tiny_llama

    # 12 ids only: </s> comes up often, so responses end at different lengths.
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"), words=[f"w{i}" for i in range(8)], seed=1)


@pytest.fixture(scope="module")
def cluster():
    import podium

    podium.init()
    yield
    podium.shutdown()


def _config(model_dir, **over):
    cfg = dict(model_path=model_dir, n=N, max_tokens=MAX_TOKENS, max_model_len=MAX_LEN,
               kv_cache_memory_bytes=4 << 20, seed=3)
    cfg.update(over)
    return cfg


@pytest.fixture(scope="module")
def rollout(cluster, model_dir):
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.rollout.vllm import VLLMRollout

    wg = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1),
                     ClassWithInitArgs(VLLMRollout, _config(model_dir)), name_prefix="rollout")
    info = wg.init_model()
    assert [i["rank"] for i in info] == [0, 1] and all(i["ready"] for i in info)
    yield wg
    wg.shutdown()


PROMPTS = [[1, 4, 5, 6], [1, 7], [1, 8, 9, 10, 11], [1, 5, 5]]


def _hf_log_probs(model_dir, out):
    from transformers import AutoModelForCausalLM

    from podium.rollout.recipes.grpo import response_log_probs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return response_log_probs(model, out)


def test_generation_fields_shapes_and_log_probs(rollout, model_dir):
    out = rollout.generate_sequences(prompt_batch(PROMPTS))
    rows, width = len(PROMPTS) * N, max(map(len, PROMPTS))
    b = out.batch
    assert len(out) == rows
    for key, shape, dtype in (("prompts", (rows, width), torch.int64), ("responses", (rows, MAX_TOKENS), torch.int64),
                              ("response_mask", (rows, MAX_TOKENS), torch.int64),
                              ("old_log_probs", (rows, MAX_TOKENS), torch.float32),
                              ("input_ids", (rows, width + MAX_TOKENS), torch.int64),
                              ("attention_mask", (rows, width + MAX_TOKENS), torch.int64),
                              ("position_ids", (rows, width + MAX_TOKENS), torch.int64),
                              ("prompt_lengths", (rows,), torch.int64), ("response_lengths", (rows,), torch.int64),
                              ("prompt_index", (rows,), torch.int64)):
        assert tuple(b[key].shape) == shape and b[key].dtype == dtype, key
    # n samples per prompt, in prompt order; the input's index column is carried.
    assert b["prompt_index"].tolist() == [100 + i for i in range(len(PROMPTS)) for _ in range(N)]
    assert b["prompt_lengths"].tolist() == [len(p) for p in PROMPTS for _ in range(N)]
    mask, lengths = b["response_mask"], b["response_lengths"]
    assert (lengths >= 1).all() and (lengths <= MAX_TOKENS).all()
    for row in range(rows):
        n_tok = int(lengths[row])
        assert mask[row].tolist() == [1] * n_tok + [0] * (MAX_TOKENS - n_tok)
        assert (b["responses"][row, n_tok:] == 0).all() and (b["old_log_probs"][row, n_tok:] == 0).all()
        if n_tok < MAX_TOKENS:
            assert int(b["responses"][row, n_tok - 1]) == 2  # stopped at </s>
    assert (b["old_log_probs"][mask.bool()] < 0).all()
    assert len(set(lengths.tolist())) > 1, "tiny vocab: some responses must stop early"
    # The engine's log-probs agree with a float32 forward pass of the same model.
    ref = _hf_log_probs(model_dir, out)
    gap = ((ref - b["old_log_probs"]).abs() * mask).max().item()
    assert gap < 2e-3, gap


def test_weights_that_force_a_token_change_generation_and_back(rollout, model_dir):
    stats = rollout.update_weights(weights=forcing_state_dict(model_dir, FORCED))
    assert all(s["tensors"] > 0 and s["bytes"] > 0 for s in stats)
    out = rollout.generate_sequences(prompt_batch(PROMPTS))
    assert (out.batch["responses"] == FORCED).all()
    assert out.batch["old_log_probs"].abs().max().item() < 1e-4
    rollout.update_weights(weights=original_state_dict(model_dir))
    out = rollout.generate_sequences(prompt_batch(PROMPTS))
    assert not (out.batch["responses"] == FORCED).all()


def test_n_from_meta_info(rollout):
    batch = prompt_batch(PROMPTS[:2], index=False)
    batch.meta_info["n"] = 1
    out = rollout.generate_sequences(batch)
    # Without an index column, the prompt's row in its rank's shard (one row per rank here).
    assert out.batch["prompt_index"].tolist() == [0, 0] and len(out) == 2


def _remote_error(fn, *args, **kwargs):
    from podium.errors import RemoteError

    with pytest.raises(RemoteError) as info:
        fn(*args, **kwargs)
    assert info.value.rank in (0, 1) and f"rank {info.value.rank}" in str(info.value)
    return info.value


def _still_serves(rollout):
    out = rollout.generate_sequences(prompt_batch(PROMPTS[:2]))
    assert len(out) == 2 * N


def test_bad_model_directories(rollout, model_dir, tmp_path):
    err = _remote_error(rollout.init_model, model_path=str(tmp_path / "missing"))
    assert "does not exist" in err.message
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((__import__("pathlib").Path(model_dir) / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    err = _remote_error(rollout.init_model, model_path=str(broken))
    assert "does not load" in err.message
    # A failed build leaves no engine, and the worker still answers; a good directory works.
    err = _remote_error(rollout.generate_sequences, prompt_batch(PROMPTS[:2]))
    assert "not built" in err.message
    assert all(i["ready"] for i in rollout.init_model(model_path=model_dir))
    _still_serves(rollout)


def test_prompt_longer_than_context(rollout):
    err = _remote_error(rollout.generate_sequences, prompt_batch([[1] + [4] * (MAX_LEN - MAX_TOKENS), [1, 4]]))
    assert "max_model_len" in err.message and "prompt row 0" in err.message
    _still_serves(rollout)


def test_weights_that_do_not_match(rollout, model_dir):
    err = _remote_error(rollout.update_weights, weights={"model.embed.weight": torch.zeros(3)})
    assert "does not have" in err.message and "model.embed.weight" in err.message
    err = _remote_error(rollout.update_weights, weights={"model.embed_tokens.weight": torch.zeros(3, 64)})
    assert "shape mismatch" in err.message and "(3, 64)" in err.message
    err = _remote_error(rollout.update_weights, source="actor")
    assert "no role 'actor'" in err.message
    _still_serves(rollout)


def test_kv_budget_too_small_and_bad_config(cluster, model_dir):
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.errors import InvalidArgumentError
    from podium.rollout.config import RolloutConfig
    from podium.rollout.vllm import VLLMRollout

    with pytest.raises(InvalidArgumentError, match="n must be"):
        RolloutConfig.from_value(_config(model_dir, n=10**6))
    with pytest.raises(InvalidArgumentError, match="unknown field"):
        RolloutConfig.from_value(dict(_config(model_dir), gpu_memory_utilization=0.9))
    wg = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1),
                     ClassWithInitArgs(VLLMRollout, _config(model_dir, kv_cache_memory_bytes=1024)))
    try:
        err = _remote_error(wg.init_model)
        assert "cannot hold one sequence" in err.message
        assert wg.engine_info()[0]["ready"] is False  # still serving, nothing built
        err = _remote_error(wg.generate_sequences, prompt_batch(PROMPTS[:1]))
        assert "not built" in err.message
    finally:
        wg.shutdown()
