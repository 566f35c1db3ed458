"""Prompts into token lists, and vLLM's answers into one padded :class:`DataProto`.

Fields of the DataProto ``generate_sequences`` returns (B prompts, n samples each,
N = B*n rows; sample j of prompt i at row ``i*n + j``; P the prompt width given, R the
config's ``max_tokens``):

==================  ==========  =======  ==================================================
field               shape       dtype    meaning
==================  ==========  =======  ==================================================
prompts             (N, P)      int64    the prompt, left-padded with the pad id
responses           (N, R)      int64    the sampled tokens, right-padded with the pad id
response_mask       (N, R)      int64    1 on sampled tokens, 0 on padding
old_log_probs       (N, R)      float32  log-prob of each sampled token under the engine's
                                         sampling distribution (after temperature); 0 on padding
input_ids           (N, P+R)    int64    prompts then responses
attention_mask      (N, P+R)    int64    the prompt's mask then response_mask
position_ids        (N, P+R)    int64    cumulative sum of attention_mask minus 1 (0 on padding)
prompt_lengths      (N,)        int64    real prompt tokens
response_lengths    (N,)        int64    sampled tokens (stops at EOS unless ignore_eos)
prompt_index        (N,)        int64    the input's ``index`` column of the prompt if it has
                                         one, else the prompt's row in this rank's shard
==================  ==========  =======  ==================================================

Other tensor columns of the input, and its ``non_tensor_batch``, are repeated ``n`` times.
"""

from __future__ import annotations

from typing import Any

from podium.dataproto import DataProto
from podium.errors import InvalidArgumentError

__all__ = ["prompt_token_lists", "build_output", "OWN_FIELDS"]

#: The fields build_output writes (input columns of these names are replaced).
OWN_FIELDS = ("prompts", "responses", "response_mask", "old_log_probs", "input_ids", "attention_mask",
              "position_ids", "prompt_lengths", "response_lengths", "prompt_index")


def prompt_token_lists(prompts: DataProto) -> list[list[int]]:
    """The token ids of each prompt row: ``raw_prompt_ids`` when given, else the
    ``input_ids`` where ``attention_mask`` is 1."""
    import torch

    raw = (prompts.non_tensor_batch or {}).get("raw_prompt_ids")
    if raw is not None:
        return [[int(t) for t in ids] for ids in raw]
    batch = prompts.batch
    if batch is None or "input_ids" not in batch.keys():
        raise InvalidArgumentError("prompts need batch['input_ids'] (with attention_mask) or "
                                   "non_tensor_batch['raw_prompt_ids']")
    ids = batch["input_ids"]
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise InvalidArgumentError(f"input_ids must be a 2-D integer tensor, got {tuple(ids.shape)} {ids.dtype}")
    mask = batch["attention_mask"] if "attention_mask" in batch.keys() else torch.ones_like(ids)
    if mask.shape != ids.shape:
        raise InvalidArgumentError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def _left_padded(token_lists: list[list[int]], width: int, pad_id: int):
    import torch

    out = torch.full((len(token_lists), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(token_lists), width), dtype=torch.int64)
    for i, ids in enumerate(token_lists):
        if ids:
            out[i, width - len(ids):] = torch.tensor(ids, dtype=torch.int64)
            mask[i, width - len(ids):] = 1
    return out, mask


def build_output(prompts: DataProto, token_lists: list[list[int]], outputs: list, *, n: int,
                 max_tokens: int, pad_id: int) -> DataProto:
    """One DataProto of every sample of every prompt (fields in this module's docstring)."""
    import numpy as np
    import torch

    rows = len(token_lists) * n
    width = max((len(t) for t in token_lists), default=0)
    if prompts.batch is not None and "input_ids" in prompts.batch.keys():
        width = max(width, prompts.batch["input_ids"].shape[1])
    prompt_ids, prompt_mask = _left_padded(token_lists, width, pad_id)
    # Padded Python rows first, then one tensor each: a tensor per sample costs more than
    # the engine's whole decode for small models.
    ids_rows: list[list[int]] = []
    lp_rows: list[list[float]] = []
    lengths: list[int] = []
    for i, request in enumerate(outputs):
        if len(request.outputs) != n:
            raise InvalidArgumentError(f"the engine returned {len(request.outputs)} samples for prompt {i}, "
                                       f"expected {n}")
        for sample in request.outputs:
            ids = list(sample.token_ids)[:max_tokens]
            lps = sample.logprobs or []
            pad = max_tokens - len(ids)
            lengths.append(len(ids))
            lp_rows.append([lps[k][tok].logprob for k, tok in enumerate(ids)] + [0.0] * pad)
            ids_rows.append(ids + [pad_id] * pad)
    responses = torch.tensor(ids_rows, dtype=torch.int64).view(rows, max_tokens)
    log_probs = torch.tensor(lp_rows, dtype=torch.float32).view(rows, max_tokens)
    response_mask = (torch.arange(max_tokens).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).to(torch.int64)
    repeat = torch.arange(len(token_lists)).repeat_interleave(n)
    prompts_rep = prompt_ids[repeat]
    mask_rep = prompt_mask[repeat]
    attention_mask = torch.cat([mask_rep, response_mask], dim=1)
    tensors: dict[str, Any] = {}
    given = prompts.batch
    if given is not None:
        for key in given.keys():
            if key not in OWN_FIELDS:
                tensors[key] = given[key][repeat]
    index = given["index"].to(torch.int64)[repeat] if given is not None and "index" in given.keys() else repeat
    tensors.update(
        prompts=prompts_rep, responses=responses, response_mask=response_mask, old_log_probs=log_probs,
        input_ids=torch.cat([prompts_rep, responses], dim=1), attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0), prompt_lengths=mask_rep.sum(1),
        response_lengths=response_mask.sum(1), prompt_index=index)
    non_tensors = {k: np.repeat(np.asarray(v, dtype=object), n, axis=0)
                   for k, v in (prompts.non_tensor_batch or {}).items()}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors or None,
                               meta_info=dict(prompts.meta_info or {}))
