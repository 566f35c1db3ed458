"""DataProto's conversions and inspection (verl's names): TensorDict round trip, files on
disk, a readable summary of what it holds, its size, and ``unfold_column_chunks``.

A mixin of :class:`podium.dataproto.DataProto`, kept apart so that module stays about
the batch container itself. Where Podium differs from verl:

* ``unfold_column_chunks(n, split_keys=None)`` repeats every non-tensor column when no
  keys are given (verl fails with ``TypeError`` there, its tensor part already repeats
  everything), and a column whose second dimension ``n`` does not divide raises
  :class:`~podium.errors.InvalidArgumentError` naming it (verl: a reshape error).
* ``to_tensordict`` refuses a key that is both a tensor and a non-tensor column with
  InvalidArgumentError (verl: an assert).
* ``load_from_disk`` reads pickles, as verl's does: only load files you trust.
"""

from __future__ import annotations

import os
import pickle
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from podium.errors import InvalidArgumentError

if TYPE_CHECKING:
    from tensordict import TensorDict

    from podium.dataproto import DataProto

__all__ = ["DataProtoIO"]


class DataProtoIO:
    """``to_tensordict``/``from_tensordict``, ``save_to_disk``/``load_from_disk``,
    ``get_data_info``, ``print_size`` and ``unfold_column_chunks`` (verl's semantics)."""

    # The fields and methods of the DataProto this is mixed into.
    batch: Any
    non_tensor_batch: dict[str, Any]
    meta_info: dict

    if TYPE_CHECKING:
        def __init__(self, batch: Any = None, non_tensor_batch: dict | None = None,
                     meta_info: dict | None = None) -> None: ...

        def __len__(self) -> int: ...

        @classmethod
        def from_dict(cls, tensors: dict | None = None, non_tensors: dict | None = None,
                      meta_info: dict | None = None, num_batch_dims: int = 1,
                      auto_padding: bool = False) -> Any: ...

    # ----------------------------------------------------------------- TensorDict

    def to_tensordict(self) -> "TensorDict":
        """One TensorDict: tensors as they are, each non-tensor column as a ``NonTensorStack``
        (one entry per row), each ``meta_info`` entry as ``NonTensorData``."""
        from tensordict import NonTensorData, NonTensorStack, TensorDict

        tensors = dict(self.batch.items()) if self.batch is not None else {}
        common = sorted(set(tensors) & set(self.non_tensor_batch) | set(tensors) & set(self.meta_info)
                        | set(self.non_tensor_batch) & set(self.meta_info))
        if common:
            raise InvalidArgumentError(f"cannot convert to one TensorDict: keys {common} are in more than "
                                       "one of batch, non_tensor_batch and meta_info")
        out = TensorDict(tensors, batch_size=(len(self),))
        for key, column in self.non_tensor_batch.items():
            out[key] = NonTensorStack(*(NonTensorData(v) for v in column.tolist()), batch_size=(len(self),))
        for key, value in self.meta_info.items():
            out.set_non_tensor(key, value)
        return out

    @classmethod
    def from_tensordict(cls, tensor_dict: "TensorDict", meta_info: dict | None = None,
                        num_batch_dims: int = 1) -> "DataProto":
        """The inverse of :meth:`to_tensordict`: ``NonTensorStack`` entries become object
        columns, ``NonTensorData`` entries ``meta_info``, tensors the batch."""
        from tensordict import NonTensorData, NonTensorStack, TensorDictBase

        if not isinstance(tensor_dict, TensorDictBase):
            raise InvalidArgumentError(f"from_tensordict takes a TensorDict, got {type(tensor_dict).__name__}")
        meta = dict(meta_info or {})
        tensors: dict[str, Any] = {}
        non_tensors: dict[str, np.ndarray] = {}
        for key in tensor_dict.keys():
            value = tensor_dict.get(key)
            if isinstance(value, NonTensorStack):
                items = value.tolist()
                column = np.empty(len(items), dtype=object)
                column[:] = items
                non_tensors[key] = column
            elif isinstance(value, NonTensorData):
                meta[key] = value.data
            else:
                tensors[key] = value
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta,
                             num_batch_dims=num_batch_dims)

    # ----------------------------------------------------------------- files

    def save_to_disk(self, filepath: str | os.PathLike) -> None:
        """Write this DataProto to ``filepath`` (a pickle, as verl's)."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f)

    @staticmethod
    def load_from_disk(filepath: str | os.PathLike) -> "DataProto":
        """Read what :meth:`save_to_disk` wrote (unpickles: trusted files only)."""
        with open(filepath, "rb") as f:
            return pickle.load(f)  # noqa: S301 - verl's format; documented as trusted-only

    # ----------------------------------------------------------------- inspection

    def get_data_info(self) -> str:
        """A multi-line summary: each tensor's shape, dtype and device, each non-tensor
        column's shape and dtype (and the element types of object columns), each
        ``meta_info`` entry's type."""
        info = ["batch"]
        if self.batch is not None:
            for key, tensor in self.batch.items():
                if hasattr(tensor, "shape") and hasattr(tensor, "dtype") and hasattr(tensor, "device"):
                    info.append(f"  {key}: {tuple(tensor.shape)} ({tensor.dtype}) {tensor.device}")
                else:
                    info.append(f"  {key}: {type(tensor).__name__}")
        info.append("non_tensor_batch")
        for key, array in self.non_tensor_batch.items():
            line = f"  {key}: ndarray{array.shape} ({array.dtype})"
            if array.dtype == object and array.size:
                kinds = sorted({type(v).__name__ for v in array.flat})
                line += f" of {', '.join(kinds)}"
            info.append(line)
        info.append("meta_info")
        for key, value in self.meta_info.items():
            info.append(f"  {key}: {type(value).__name__}")
        return "\n".join(info)

    def print_size(self, prefix: str = "") -> None:
        """Print the batch's and the non-tensor columns' sizes in GB (verl's message)."""
        tensors = 0
        if self.batch is not None:
            for _, tensor in self.batch.items():
                tensors += tensor.element_size() * tensor.numel()
        arrays = sum(array.nbytes for array in self.non_tensor_batch.values())
        message = (f"Size of tensordict: {tensors / 1024 ** 3} GB, size of non_tensor_batch: "
                   f"{arrays / 1024 ** 3} GB")
        print(f"{prefix}, {message}" if prefix else message)

    # ----------------------------------------------------------------- reshaping

    def unfold_column_chunks(self, n_split: int, split_keys: list[str] | None = None) -> "DataProto":
        """Split each column in ``split_keys`` along dim 1 into ``n_split`` pieces and move
        them to the batch dim (row ``i`` becomes rows ``i*n .. i*n+n-1``); every other
        column is repeated ``n_split`` times row by row to match."""
        from tensordict import TensorDict

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

        batch = None
        if self.batch is not None:
            columns = {key: unfold(key, t) if key in keys else torch.repeat_interleave(t, n_split, dim=0)
                       for key, t in self.batch.items()}
            batch = TensorDict(columns, batch_size=(self.batch.batch_size[0] * n_split,),
                               device=self.batch.device)
        non_tensor = {key: unfold(key, v) if key in keys else np.repeat(v, n_split, axis=0)
                      for key, v in self.non_tensor_batch.items()}
        rebuilt: Any = type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)
        return rebuilt
