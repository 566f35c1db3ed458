"""Row operations on the two row-aligned parts of a DataProto: ``batch`` (a TensorDict with
one batch dimension, or None) and ``non_tensor_batch`` (numpy columns with as many rows).

Each function takes the parts it works on and returns new parts (a ``(batch, non_tensor_batch)``
pair); :class:`podium.dataproto.DataProto` builds its result from them, so these functions
hold no DataProto and no state.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from podium.dataproto.dicts import list_of_dict_to_dict_of_list, values_equal
from podium.errors import InvalidArgumentAssertion, InvalidArgumentError
from podium.rowcat import cat_tensordicts

__all__ = ["Parts", "concat_parts", "merge_meta_info", "chunk_parts", "take_rows", "repeat_rows", "repeat_rows_each",
           "unfold_columns"]

#: ``(batch, non_tensor_batch)``: a TensorDict or None, and a dict of numpy columns.
Parts = tuple[Any, dict[str, np.ndarray]]


def concat_parts(batches: Sequence[Any], non_tensors: Sequence[dict[str, np.ndarray]]) -> Parts:
    """The rows of every part one after another (the batches through :mod:`podium.rowcat`)."""
    batch = cat_tensordicts(list(batches)) if batches[0] is not None else None
    columns: dict[str, Any] = list_of_dict_to_dict_of_list(list(non_tensors))
    return batch, {key: np.concatenate(parts, axis=0) for key, parts in columns.items()}


def merge_meta_info(metas: Sequence[dict]) -> dict:
    """``DataProto.concat``'s meta_info: keys other than ``metrics`` merged (equal values only),
    every part's ``metrics`` (a dict, or a list of dicts) gathered into one dict of lists."""
    merged: dict[str, Any] = {}
    all_metrics: list[dict] = []
    for meta in metas:
        for key, val in meta.items():
            if key == "metrics":
                if isinstance(val, list):
                    all_metrics.extend(val)
                elif val is not None:
                    all_metrics.append(val)
            elif key in merged:
                if not values_equal(merged[key], val):
                    raise InvalidArgumentAssertion(f"Conflicting values for meta_info key '{key}'")
            else:
                merged[key] = val
    if all_metrics:
        merged["metrics"] = list_of_dict_to_dict_of_list(all_metrics)
    return merged


def chunk_parts(batch: Any, non_tensor: dict[str, np.ndarray], chunks: int) -> list[Parts]:
    """``chunks`` pieces along the rows, as ``torch.chunk`` cuts the batch (the non-tensor
    columns cut at the same rows). Raises InvalidArgumentAssertion when torch makes fewer."""
    if batch is None:
        batches: list[Any] = [None] * chunks
        cuts: Any = chunks
    else:
        batches = list(batch.chunk(chunks=chunks, dim=0))
        if len(batches) != chunks:
            raise InvalidArgumentAssertion(
                f"cannot split {batch.batch_size[0]} rows into {chunks} chunks (torch.chunk makes "
                f"{len(batches)}); pad to a multiple of {chunks} first")
        cuts = list(itertools.accumulate(b.batch_size[0] for b in batches[:-1]))
    pieces: list[dict[str, np.ndarray]] = [{} for _ in range(chunks)]
    for key, val in non_tensor.items():
        for piece, part in zip(pieces, np.array_split(val, cuts)):
            piece[key] = part
    return list(zip(batches, pieces))


def take_rows(batch: Any, non_tensor: dict[str, np.ndarray], idxs: list | np.ndarray | torch.Tensor) -> Parts:
    """The rows at ``idxs`` (integer indices or a boolean mask)."""
    if isinstance(idxs, list):
        idxs = torch.tensor(idxs)
        if idxs.dtype != torch.bool:
            idxs = idxs.type(torch.int64)
    if isinstance(idxs, np.ndarray):
        idxs_np, idxs_torch = idxs, torch.from_numpy(idxs)
    else:
        idxs_torch, idxs_np = idxs, idxs.detach().cpu().numpy()
    rows = int(idxs_np.sum()) if idxs_np.dtype == bool else idxs_np.shape[0]
    taken = None
    if batch is not None:
        taken = TensorDict(source={key: t[idxs_torch] for key, t in batch.items()}, batch_size=(rows,),
                           device=batch.device)
    return taken, {key: val[idxs_np] for key, val in non_tensor.items()}


def repeat_rows(batch: Any, non_tensor: dict[str, np.ndarray], times: int, interleave: bool) -> Parts:
    """Each row ``times`` times: ``aabb`` with ``interleave``, else ``abab``."""
    repeated = None
    if batch is not None:
        if interleave:
            tensors = {key: t.repeat_interleave(times, dim=0) for key, t in batch.items()}
        else:
            tensors = {key: t.unsqueeze(0).expand(times, *t.shape).reshape(-1, *t.shape[1:])
                       for key, t in batch.items()}
        repeated = TensorDict(source=tensors, batch_size=(batch.batch_size[0] * times,), device=batch.device)
    if interleave:
        columns = {key: np.repeat(val, times, axis=0) for key, val in non_tensor.items()}
    else:
        columns = {key: np.tile(val, (times,) + (1,) * (val.ndim - 1)) for key, val in non_tensor.items()}
    return repeated, columns


def repeat_rows_each(batch: Any, non_tensor: dict[str, np.ndarray],
                counts: list[int] | tuple | np.ndarray | torch.Tensor) -> Parts:
    """Row ``i`` repeated ``counts[i]`` times."""
    if isinstance(counts, (torch.Tensor, np.ndarray)):
        if len(counts.shape) != 1:
            raise InvalidArgumentAssertion(f"repeat_times must be one-dimensional, got shape {tuple(counts.shape)}")
        counts = counts.tolist()
    counts = list(counts)
    per_row = torch.tensor(counts)
    repeated = None
    if batch is not None:
        tensors = {key: t.repeat_interleave(per_row, dim=0) for key, t in batch.items()}
        repeated = TensorDict(source=tensors, batch_size=(int(per_row.sum().item()),), device=batch.device)
    return repeated, {key: np.repeat(val, counts, axis=0) for key, val in non_tensor.items()}


def unfold_columns(batch: Any, non_tensor: dict[str, np.ndarray], n_split: int,
                   split_keys: list[str] | None) -> Parts:
    """Split each column in ``split_keys`` along dim 1 into ``n_split`` pieces moved to the
    batch dim (row ``i`` becomes rows ``i*n .. i*n+n-1``); every other column is repeated
    ``n_split`` times row by row to match. InvalidArgumentError for an ``n_split`` that is not
    a positive int or a column whose second dimension it does not divide."""
    if not isinstance(n_split, int) or n_split < 1:
        raise InvalidArgumentError(f"n_split must be a positive int, got {n_split!r}")
    keys = set(split_keys or ())

    def unfold(key: str, value: Any) -> Any:
        if value.ndim < 2 or value.shape[1] % n_split:
            raise InvalidArgumentError(
                f"cannot unfold column {key!r} of shape {tuple(value.shape)} into {n_split} chunks: "
                f"its second dimension must divide by {n_split}")
        shape = list(value.shape)
        shape[0], shape[1] = shape[0] * n_split, shape[1] // n_split
        return value.reshape(*shape)

    unfolded = None
    if batch is not None:
        columns = {key: unfold(key, t) if key in keys else torch.repeat_interleave(t, n_split, dim=0)
                   for key, t in batch.items()}
        unfolded = TensorDict(columns, batch_size=(batch.batch_size[0] * n_split,), device=batch.device)
    return unfolded, {key: unfold(key, v) if key in keys else np.repeat(v, n_split, axis=0)
                      for key, v in non_tensor.items()}
