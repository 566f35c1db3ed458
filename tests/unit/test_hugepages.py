"""podium.hugepages: row concatenation into huge-page-advised tensors gives exactly
torch.cat's result, and falls back to torch.cat for whatever it does not handle."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from podium import hugepages
from podium.protocol import DataProto

BIG_ROWS = 64  # x 32768 float32 columns = 8 MiB: above MIN_BYTES


def _parts(dtype=torch.float32, cols=32768):
    return [torch.randn(BIG_ROWS // 2, cols).to(dtype), torch.randn(BIG_ROWS // 2, cols).to(dtype)]


def test_the_threshold_is_above_a_huge_page():
    assert hugepages.MIN_BYTES >= 2 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_tensor_rows_equal_torch_cat(dtype):
    parts = _parts(dtype)
    got = hugepages.cat_rows(parts)
    assert got.dtype == dtype and torch.equal(got, torch.cat(parts))


def test_empty_is_an_ordinary_writable_tensor():
    tensor = hugepages.empty((BIG_ROWS, 32768), torch.float32)
    tensor.fill_(3.0)
    tensor.resize_(2, 2)  # torch's allocator owns it: even resizing works
    assert tensor.shape == (2, 2)


def test_tensordicts_with_nested_entries_equal_torch_cat():
    def td(rows, value):
        return TensorDict({"x": torch.full((rows, 32768), value),
                           "meta": TensorDict({"ids": torch.arange(rows)}, batch_size=[rows])},
                          batch_size=[rows])
    parts = [td(40, 1.0), td(24, 2.0)]
    got = hugepages.cat_rows(parts)
    want = torch.cat(parts, dim=0)
    assert got.batch_size == want.batch_size == torch.Size([64])
    assert torch.equal(got["x"], want["x"]) and torch.equal(got["meta", "ids"], want["meta", "ids"])


def test_what_it_does_not_handle_goes_to_torch_cat():
    grad = [torch.randn(BIG_ROWS, 32768, requires_grad=True), torch.randn(1, 32768)]
    assert hugepages.cat_rows(grad).requires_grad  # out= would refuse autograd
    mixed = [torch.ones(BIG_ROWS, 32768), torch.ones(1, 32768, dtype=torch.float64)]
    assert hugepages.cat_rows(mixed).dtype == torch.float64  # type promotion, as torch.cat
    with pytest.raises(RuntimeError):
        hugepages.cat_rows([torch.ones(BIG_ROWS, 3), torch.ones(2, 4)])


def test_data_proto_concat_is_bit_exact():
    parts = [DataProto.from_dict(tensors={"x": t}) for t in _parts(torch.float16)]
    out = DataProto.concat(parts)
    assert torch.equal(out.batch["x"], torch.cat([p.batch["x"] for p in parts]))


def test_off_switch(monkeypatch):
    monkeypatch.setenv("PODIUM_HUGEPAGES", "0")
    hugepages._madvise.cache_clear()
    try:
        assert not hugepages.enabled()
        parts = _parts()
        assert torch.equal(hugepages.cat_rows(parts), torch.cat(parts))
    finally:
        hugepages._madvise.cache_clear()  # read again, with the switch restored, by the next caller
