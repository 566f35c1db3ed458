"""DataProto's conversions and inspection: the TensorDict round trip, a readable summary of
what it holds, and its size.

Functions over the three parts a DataProto holds (``batch``, ``non_tensor_batch``,
``meta_info``), passed explicitly; :class:`podium.dataproto.DataProto`'s methods of the same
names call them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from podium.errors import InvalidArgumentError

__all__ = ["tensordict_of", "tensordict_parts", "data_info", "size_message"]


def tensordict_of(batch: Any, non_tensor: dict[str, np.ndarray], meta_info: dict, rows: int) -> Any:
    """One TensorDict of ``rows`` rows: tensors as they are, each non-tensor column as a
    ``NonTensorStack`` (one entry per row), each ``meta_info`` entry as ``NonTensorData``.
    InvalidArgumentError for a key in more than one of the three."""
    tensors = dict(batch.items()) if batch is not None else {}
    common = sorted(set(tensors) & set(non_tensor) | set(tensors) & set(meta_info)
                    | set(non_tensor) & set(meta_info))
    if common:
        raise InvalidArgumentError(f"cannot convert to one TensorDict: keys {common} are in more than "
                                   "one of batch, non_tensor_batch and meta_info")
    out = TensorDict(tensors, batch_size=(rows,))
    for key, column in non_tensor.items():
        out[key] = NonTensorStack(*(NonTensorData(v) for v in column.tolist()), batch_size=(rows,))
    for key, value in meta_info.items():
        out.set_non_tensor(key, value)
    return out


def tensordict_parts(tensor_dict: Any, meta_info: dict | None) -> tuple[dict, dict[str, np.ndarray], dict]:
    """The inverse of :func:`tensordict_of`, as ``(tensors, non_tensors, meta_info)``:
    ``NonTensorStack`` entries become object columns, ``NonTensorData`` entries ``meta_info``
    (added to a copy of the given one), tensors the batch."""
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
    return tensors, non_tensors, meta


def data_info(batch: Any, non_tensor: dict[str, np.ndarray], meta_info: dict) -> str:
    """A multi-line summary: each tensor's shape, dtype and device, each non-tensor column's
    shape and dtype (and the element types of object columns), each ``meta_info`` entry's type."""
    info = ["batch"]
    if batch is not None:
        for key, tensor in batch.items():
            if hasattr(tensor, "shape") and hasattr(tensor, "dtype") and hasattr(tensor, "device"):
                info.append(f"  {key}: {tuple(tensor.shape)} ({tensor.dtype}) {tensor.device}")
            else:
                info.append(f"  {key}: {type(tensor).__name__}")
    info.append("non_tensor_batch")
    for key, array in non_tensor.items():
        line = f"  {key}: ndarray{array.shape} ({array.dtype})"
        if array.dtype == object and array.size:
            kinds = sorted({type(v).__name__ for v in array.flat})
            line += f" of {', '.join(kinds)}"
        info.append(line)
    info.append("meta_info")
    for key, value in meta_info.items():
        info.append(f"  {key}: {type(value).__name__}")
    return "\n".join(info)


def size_message(batch: Any, non_tensor: dict[str, np.ndarray]) -> str:
    """The batch's and the non-tensor columns' sizes in GB (verl's ``print_size`` message)."""
    tensors = 0
    if batch is not None:
        for _, tensor in batch.items():
            tensors += tensor.element_size() * tensor.numel()
    arrays = sum(array.nbytes for array in non_tensor.values())
    return (f"Size of tensordict: {tensors / 1024 ** 3} GB, size of non_tensor_batch: "
            f"{arrays / 1024 ** 3} GB")
