"""podium.rowcat: the same values as torch.cat, large plain tensors in reused memory."""

from __future__ import annotations

import gc

import pytest
import torch
from tensordict import TensorDict

from podium import rowcat
from podium.memorypool import POOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
def test_large_parts_give_torch_cat_values_in_pooled_memory(dtype):
    parts = [(torch.randn(rows, 8192) * 100).to(dtype) for rows in (64, 1, 127)]  # >= 1.5 MiB
    created = POOL.created + POOL.reused
    out = rowcat.cat_rows(parts)
    assert POOL.created + POOL.reused == created + 1  # pooled
    want = torch.cat(parts)
    assert out.dtype == want.dtype and out.shape == want.shape
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    out[0] = out[1]  # writable


def test_the_result_memory_goes_back_to_the_pool_when_dropped():
    parts = [torch.ones(256, 1024) for _ in range(4)]  # 4 MiB
    out = rowcat.cat_rows(parts)
    idle = POOL.idle_bytes
    del out
    gc.collect()
    assert POOL.idle_bytes >= idle + (4 << 20)
    reused = POOL.reused
    rowcat.cat_rows(parts)
    assert POOL.reused == reused + 1


@pytest.mark.parametrize("case", ["small", "strided", "grad", "mixed_dtypes"])
def test_other_tensors_take_torch_cat(case):
    if case == "small":
        parts = [torch.ones(4, 4), torch.zeros(2, 4)]
    elif case == "strided":
        parts = [torch.randn(1024, 600)[:, ::2], torch.randn(10, 300)]
    elif case == "grad":
        parts = [torch.randn(1024, 512, requires_grad=True), torch.randn(3, 512)]
    else:
        parts = [torch.randn(1024, 512), torch.randn(3, 512, dtype=torch.float64)]
    created = POOL.created + POOL.reused
    out = rowcat.cat_rows(parts)
    assert POOL.created + POOL.reused == created
    assert torch.equal(out, torch.cat(parts))
    if case == "grad":
        assert out.requires_grad


def test_tensordicts_concatenate_like_torch_cat():
    parts = [TensorDict({"x": torch.randn(rows, 2048), "mask": torch.rand(rows, 2048) > 0.5},
                        batch_size=[rows]) for rows in (100, 60)]
    out = rowcat.cat_tensordicts(parts)
    want = torch.cat(parts, dim=0)
    assert out.batch_size == want.batch_size and set(out.keys()) == set(want.keys())
    for key in want.keys():
        assert torch.equal(out[key], want[key])


def test_nested_tensordicts_fall_back_to_torch_cat():
    parts = [TensorDict({"a": TensorDict({"b": torch.ones(3, 2)}, batch_size=[3])}, batch_size=[3])] * 2
    out = rowcat.cat_tensordicts(parts)
    assert torch.equal(out["a", "b"], torch.ones(6, 2))
