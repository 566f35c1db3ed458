"""Row helpers of :mod:`podium.dataproto`: collating items, padding to a divisor, unpadding.

Re-exported from :mod:`podium.dataproto` (verl's names). DataProto is imported when called,
so this module and ``podium.dataproto`` can import each other.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from podium.dataproto_dicts import list_of_dict_to_dict_of_list
from podium.rowcat import cat_tensordicts

if TYPE_CHECKING:
    from podium.dataproto import DataProto, DataProtoItem

__all__ = ["collate_fn", "pad_dataproto_to_divisor", "unpad_dataproto", "concat_rows"]

logger = logging.getLogger("podium.dataproto")


def collate_fn(x: list[DataProtoItem]) -> DataProto:
    """Stack DataProtoItems back into a DataProto (the DataLoader collate of make_iterator)."""
    batch = torch.stack([d.batch for d in x]).contiguous()
    non_tensor_batch: dict[str, Any] = list_of_dict_to_dict_of_list([d.non_tensor_batch for d in x])
    for key, val in non_tensor_batch.items():
        non_tensor_batch[key] = np.array(val, dtype=object)
    from podium.dataproto import DataProto

    return DataProto(batch=batch, non_tensor_batch=non_tensor_batch)


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` so its length divides by ``size_divisor``, cycling rows from the start.

    ``[r0, r1, r2]`` with divisor 7 becomes ``r0 r1 r2 r0 r1 r2 r0``. Returns
    ``(padded, pad_size)``; ``data`` itself is not changed.
    """
    from podium.dataproto import DataProto

    assert isinstance(data, DataProto), "data must be a DataProto"
    if len(data) % size_divisor == 0:
        if len(data) == 0:
            logger.warning("padding a DataProto with no item, no changed made")
        return data, 0
    pad_size = size_divisor - len(data) % size_divisor
    parts = [data]
    remaining = pad_size
    while remaining > 0:
        take = min(remaining, len(data))
        parts.append(data[:take])
        remaining -= take
    return _concat_rows(parts, data.meta_info), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows (``data[:-pad_size]``); no-op for 0."""
    if pad_size != 0:
        data = data[:-pad_size]
    return data


def _concat_rows(parts: list[DataProto], meta_info: dict) -> DataProto:
    # Row concatenation with a given meta_info: padding must not run meta_info
    # through concat's metrics merge (the same metrics would be counted twice).
    batches = [p.batch for p in parts]
    batch = cat_tensordicts(batches) if batches[0] is not None else None
    non_tensor = {key: np.concatenate([p.non_tensor_batch[key] for p in parts], axis=0)
                  for key in parts[0].non_tensor_batch}
    return type(parts[0])(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)


#: Public name of the row concatenation that keeps meta_info (padding uses it).
concat_rows = _concat_rows
