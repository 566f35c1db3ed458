"""flash-attn's padding helpers (``flash_attn/bert_padding.py`` in flash-attn 2.8), in plain torch.

They move rows between a padded ``(batch, seqlen, ...)`` layout and a packed ``(tokens, ...)``
one; nothing in them needs CUDA, so they are written out here with the same signatures and
results (the real ones use ``gather``/``scatter`` autograd functions for speed; indexing gives
the same values and gradients).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "rearrange", "unpad_input"]


def index_first_axis(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The rows of ``values`` (first axis) at ``indices``."""
    return values[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A zero tensor of ``first_axis_dim`` rows with ``values`` written at the rows ``indices``."""
    output = torch.zeros(first_axis_dim, *values.shape[1:], device=values.device, dtype=values.dtype)
    return output.index_put((indices,), values)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Pack the tokens the mask keeps.

    Returns the packed ``(tokens, ...)`` states, their flat indices in ``batch * seqlen``, the
    cumulative sequence lengths (int32, starting at 0), the longest sequence, and the lengths of
    the used (``attention_mask``) tokens per sequence, as flash-attn 2.8 does.
    """
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    packed = index_first_axis(rearrange(hidden_states, "b s ... -> (b s) ..."), indices)
    return packed, indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Unpack ``(tokens, ...)`` states back to ``(batch, seqlen, ...)``, zeros where padded."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return rearrange(output, "(b s) ... -> b s ...", b=batch)
