"""Large CPU tensors on transparent huge pages, and row concatenation into them.

A fresh 128 MiB tensor costs 32,768 page faults the first time it is written (the kernel
hands out and zeroes each 4 KiB page): on the 2-core machines Podium targets that is
~35 ms, five times the copy itself. The same memory marked ``MADV_HUGEPAGE`` before its
first write faults in 2 MiB pages: ``torch.cat`` of two 64 MiB halves took 15 ms instead
of 58. The controller concatenates every rank's result of a ``DP_COMPUTE_PROTO`` call,
so this is on the path of every training step.

The tensor is an ordinary ``torch.empty`` tensor (torch's allocator owns and frees it);
only the advice is added, and only where the kernel's THP mode is ``always`` or
``madvise``. ``PODIUM_HUGEPAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from typing import Any

import torch

__all__ = ["MIN_BYTES", "enabled", "empty", "cat_rows"]

#: Tensors smaller than this are allocated as usual (a huge page is 2 MiB).
MIN_BYTES = 4 << 20
_HUGE_PAGE = 2 << 20
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.lru_cache(maxsize=1)
def _madvise() -> Any:
    """libc's madvise, or None where there is no THP to ask for."""
    if os.environ.get("PODIUM_HUGEPAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        with open(_THP_MODE) as handle:
            mode = handle.read()
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    if "[always]" not in mode and "[madvise]" not in mode:
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def enabled() -> bool:
    """Whether :func:`empty` asks for huge pages here."""
    return _madvise() is not None


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, its whole 2 MiB pages advised huge
    when it is at least :data:`MIN_BYTES` (before anything touches them)."""
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    madvise = _madvise() if nbytes >= MIN_BYTES else None
    if madvise is not None:
        start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        end = (tensor.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if end > start:
            madvise(start, end - start, mmap.MADV_HUGEPAGE)  # advice: a failure only costs speed
    return tensor


def cat_rows(parts: list[Any]) -> Any:
    """``torch.cat(parts, dim=0)`` for CPU tensors or TensorDicts of plain tensors, the
    result's large tensors from :func:`empty`; anything else goes to ``torch.cat`` as is."""
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    if isinstance(first, torch.Tensor):
        if not _plain(first) or not all(_plain(p) and p.dtype == first.dtype for p in parts):
            return torch.cat(parts, dim=0)
        return torch.cat(parts, dim=0, out=empty((rows, *first.shape[1:]), first.dtype))
    leaves = [list(p.values(include_nested=True, leaves_only=True)) for p in parts]
    if (not enabled() or first.device not in (None, torch.device("cpu"))
            or not all(_plain(t) for ts in leaves for t in ts)
            or sum(t.numel() * t.element_size() for t in leaves[0]) * len(parts) < MIN_BYTES):
        return torch.cat(parts, dim=0)
    out = first.apply(lambda t: empty((rows, *t.shape[1:]), t.dtype),
                      batch_size=[rows, *first.batch_size[1:]])
    return torch.cat(parts, dim=0, out=out)


def _plain(value: Any) -> bool:
    return (type(value) is torch.Tensor and value.device.type == "cpu" and value.layout == torch.strided
            and not value.is_nested and value.dim() > 0 and not value.requires_grad)
