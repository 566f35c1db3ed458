"""Padding a DataProto to a divisor and taking the padding off again (verl's module-level
``pad_dataproto_to_divisor`` and ``unpad_dataproto``, re-exported from :mod:`podium.dataproto`).

Padding keeps ``meta_info`` as it is instead of running it through the ``metrics`` merge of
:meth:`DataProto.concat` (which would count the same metrics twice).
"""

from __future__ import annotations

import logging

import numpy as np

from podium.dataproto.container import DataProto
from podium.dataproto.rows import concat_parts
from podium.errors import InvalidArgumentAssertion, InvalidArgumentError

__all__ = ["pad_dataproto_to_divisor", "unpad_dataproto"]

logger = logging.getLogger("podium.dataproto")


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` so its length divides by ``size_divisor``, cycling rows from the start.

    ``[r0, r1, r2]`` with divisor 7 becomes ``r0 r1 r2 r0 r1 r2 r0``. Returns
    ``(padded, pad_size)``; ``data`` itself is not changed.
    """
    if not isinstance(data, DataProto):
        raise InvalidArgumentAssertion(f"data must be a DataProto, got {type(data).__name__}")
    if not isinstance(size_divisor, (int, np.integer)) or size_divisor < 1:
        raise InvalidArgumentError(f"size_divisor must be a positive int, got {size_divisor!r}")
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
    padded = concat_parts([p.batch for p in parts], [p.non_tensor_batch for p in parts])
    return type(data)(batch=padded[0], non_tensor_batch=padded[1], meta_info=data.meta_info), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows (``data[:-pad_size]``); no-op for 0."""
    if pad_size != 0:
        data = data[:-pad_size]
    return data
