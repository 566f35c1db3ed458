"""Concatenating tensors along their rows into reused memory (a group's gathered results).

A ``DP_COMPUTE_PROTO`` call returns one shard per rank and the controller concatenates
them. ``torch.cat`` writes into a fresh allocation, and on the machines Podium targets
the first touch of fresh memory costs far more than the copy (~180 ms against ~20 ms
for 128 MiB: see :mod:`podium.memorypool`); torch's own copy loop is also
2-3x slower there than ``memmove``. So a large concatenation of plain CPU tensors goes
into a mapping from the process's receive pool (given back when the result dies) with
one ``memmove`` per part, or, when the parts already lie one after another in one staged
segment (results computed in place, :mod:`podium.transport.shmstage`), is a view of
those bytes with no copy at all; anything else (small, CUDA, strided, autograd, nested
TensorDicts) is ``torch.cat`` as before. The values are the same either way.

This module is below the transport and does not know staged segments itself: it asks
:func:`podium.spans.find`, which the transport fills.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from podium import spans
from podium.memorypool import MIN_POOLED_BYTES, POOL, move

__all__ = ["cat_rows", "cat_tensordicts"]


def _poolable(tensors: list[torch.Tensor]) -> bool:
    first = tensors[0]
    return all(t.device.type == "cpu" and t.dtype == first.dtype and t.layout == torch.strided
               and not t.requires_grad and t.is_contiguous() and t.dim() >= 1 and t.shape[1:] == first.shape[1:]
               for t in tensors) and sum(t.nbytes for t in tensors) >= MIN_POOLED_BYTES


def _adjacent_span(tensors: list[torch.Tensor], nbytes: int) -> memoryview | None:
    # Rows of several ranks' results computed in place in one staged segment lie one after
    # another there, as they did in the batch: a view of that run of bytes is their
    # concatenation.
    at = start = tensors[0].data_ptr()
    for t in tensors:
        if t.data_ptr() != at:
            return None
        at += t.nbytes
    return spans.find(start, nbytes)


def cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors, dim=0)``; large plain CPU tensors land in reused memory, or are
    a view of the staged segment they already lie in, one after another."""
    if not tensors or not _poolable(tensors):
        return torch.cat(tensors, dim=0)
    first = tensors[0]
    rows = sum(t.shape[0] for t in tensors)
    nbytes = sum(t.nbytes for t in tensors)
    span = _adjacent_span(tensors, nbytes) if len(tensors) > 1 else None
    if span is not None:
        return torch.frombuffer(span, dtype=first.dtype).view(rows, *first.shape[1:])
    view = POOL.lease(POOL.take(nbytes), nbytes)
    out = torch.frombuffer(view, dtype=first.dtype).view(rows, *first.shape[1:])
    at = out.data_ptr()
    moves = []
    for t in tensors:
        moves.append((at, t.data_ptr(), t.nbytes))
        at += t.nbytes
    move(moves)
    return out


def cat_tensordicts(parts: list[Any]) -> Any:
    """``torch.cat(parts, dim=0)`` of TensorDicts, each flat leaf through :func:`cat_rows`.

    TensorDicts with nested TensorDicts, a device, or more than one batch dimension go
    to ``torch.cat`` unchanged.
    """
    first = parts[0]
    keys = list(first.keys())
    if (len(first.batch_size) != 1 or first.device is not None
            or any(not isinstance(first.get(key), torch.Tensor) or isinstance(first.get(key), TensorDict)
                   for key in keys)
            or any(set(p.keys()) != set(keys) for p in parts[1:])):
        return torch.cat(parts, dim=0)
    rows = sum(p.batch_size[0] for p in parts)
    return TensorDict({key: cat_rows([p.get(key) for p in parts]) for key in keys}, batch_size=[rows])
