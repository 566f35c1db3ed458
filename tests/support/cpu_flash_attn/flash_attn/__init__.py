"""A test-support stand-in for flash-attn, for the OpenRLHF test only (not part of Podium).

flash-attn is a CUDA-only package: it has no CPU build, and its import loads its CUDA
extension. OpenRLHF 0.11.2 imports it at module level
(``openrlhf/models/ring_attn_utils.py:3-4``), so on a machine without CUDA its trainer modules
cannot even be imported, and the test could never reach OpenRLHF's first GPU-only line.
tests/integration/frameworks/test_openrlhf.py puts this folder's parent on PYTHONPATH, and only
there. It holds only the names OpenRLHF imports at module level, written in plain torch:
``bert_padding``'s padding helpers and ``utils.distributed.all_gather``. The attention kernels
themselves are not here: :func:`flash_attn_func` and :func:`flash_attn_varlen_func` raise
:class:`FlashAttnNeedsCuda`.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["FlashAttnNeedsCuda", "flash_attn_func", "flash_attn_varlen_func"]


class FlashAttnNeedsCuda(RuntimeError):
    """A flash-attn kernel was called: the real ones are CUDA kernels, and this stand-in has none."""


def _needs_cuda(name: str) -> NoReturn:
    raise FlashAttnNeedsCuda(f"flash-attn needs CUDA: {name} is a CUDA kernel, and this is the CPU stand-in "
                             "(tests/support/cpu_flash_attn)")


def flash_attn_func(*args: object, **kwargs: object) -> NoReturn:
    """The fused attention kernel: GPU-only, so it raises :class:`FlashAttnNeedsCuda`."""
    _needs_cuda("flash_attn_func")


def flash_attn_varlen_func(*args: object, **kwargs: object) -> NoReturn:
    """The variable-length fused attention kernel: GPU-only, so it raises :class:`FlashAttnNeedsCuda`."""
    _needs_cuda("flash_attn_varlen_func")
