"""The dict helpers of DataProto (verl's ``union_*`` and friends), re-exported from
:mod:`podium.dataproto`, where verl code looks for them.

Where verl asserts, these raise :class:`~podium.errors.InvalidArgumentAssertion` (an
``AssertionError`` too) naming the key and what differs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from podium.errors import InvalidArgumentAssertion

__all__ = ["union_tensor_dict", "union_numpy_dict", "union_two_dict", "list_of_dict_to_dict_of_list",
           "values_equal"]


def values_equal(a: Any, b: Any) -> bool:
    """Whether two ``meta_info`` or non-tensor values are equal: arrays and tensors element by
    element (their ``==`` is element-wise), NaN equal to NaN as in verl's ``_deep_equal``,
    lists, tuples and dicts item by item."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype != object:
            return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
        return all(values_equal(x, y) for x, y in zip(a.flat, b.flat))
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # an == that cannot be made a bool: treat as different
        return False


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add the keys of ``tensor_dict2`` to ``tensor_dict1`` (in place) and return it.

    Batch sizes must match, and a key in both must hold equal tensors.
    """
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise InvalidArgumentAssertion(
            f"Two tensor dict must have identical batch size. Got {tuple(tensor_dict1.batch_size)} and "
            f"{tuple(tensor_dict2.batch_size)}")
    for key in tensor_dict2.keys():
        if key not in tensor_dict1.keys():
            tensor_dict1[key] = tensor_dict2[key]
        elif not tensor_dict1[key].equal(tensor_dict2[key]):
            raise InvalidArgumentAssertion(f"{key} in tensor_dict1 and tensor_dict2 are not the same object")
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray],
                     tensor_dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add the arrays of ``tensor_dict2`` to ``tensor_dict1`` (in place) and return it.

    A key in both must hold equal arrays (NaN equals NaN, object arrays compared
    element by element).
    """
    for key, val in tensor_dict2.items():
        if key in tensor_dict1:
            for side, array in (("tensor_dict1", tensor_dict1[key]), ("tensor_dict2", val)):
                if not isinstance(array, np.ndarray):
                    raise InvalidArgumentAssertion(f"`{key}` in {side} is a {type(array).__name__}, "
                                                   "not a numpy.ndarray")
            if not values_equal(tensor_dict1[key], val):
                raise InvalidArgumentAssertion(f"`{key}` in tensor_dict1 and tensor_dict2 are not the same object.")
        tensor_dict1[key] = val
    return tensor_dict1


def union_two_dict(dict1: dict, dict2: dict) -> dict:
    """Add the entries of ``dict2`` to ``dict1`` (in place); shared keys must agree."""
    for key, val in dict2.items():
        if key in dict1 and not values_equal(dict1[key], val):
            raise InvalidArgumentAssertion(f"{key} in meta_dict1 and meta_dict2 are not the same object")
        dict1[key] = val
    return dict1


def list_of_dict_to_dict_of_list(list_of_dict: list[dict]) -> dict[str, list]:
    """``[{"a": 1}, {"a": 2}]`` -> ``{"a": [1, 2]}`` (keys in first-seen order)."""
    output: dict[str, list] = {}
    for data in list_of_dict:
        for key, item in data.items():
            output.setdefault(key, []).append(item)
    return output
