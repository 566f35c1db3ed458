"""The CPU flash-attn stand-in (tests/support/cpu_flash_attn) that the OpenRLHF run imports:
its padding helpers give flash-attn 2.8's results, ``all_gather`` gathers in rank order over a
real gloo group, and the attention kernels refuse naming CUDA. Runs where the OpenRLHF tests do
(einops comes with tools/install-openrlhf.sh).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.openrlhf]
einops = pytest.importorskip("einops", reason="einops is not installed (tools/install-openrlhf.sh installs it)")
torch = pytest.importorskip("torch")

STANDIN = str(Path(__file__).resolve().parents[2] / "support" / "cpu_flash_attn")


@pytest.fixture()
def flash_attn(monkeypatch):
    monkeypatch.syspath_prepend(STANDIN)
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    import flash_attn
    assert flash_attn.__file__.startswith(STANDIN)
    return flash_attn


def test_unpad_then_pad_gives_back_the_kept_tokens_and_zeros_elsewhere(flash_attn):
    from flash_attn.bert_padding import pad_input, unpad_input
    states = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]])
    packed, indices, cu_seqlens, max_len, used = unpad_input(states, mask)
    assert packed.tolist() == [states[0, 0].tolist(), states[0, 1].tolist(), states[0, 2].tolist(),
                               states[1, 1].tolist(), states[1, 2].tolist()]
    assert indices.tolist() == [0, 1, 2, 5, 6]
    assert cu_seqlens.tolist() == [0, 3, 5] and cu_seqlens.dtype == torch.int32
    assert max_len == 3 and used.tolist() == [3, 2]
    padded = pad_input(packed, indices, 2, 4)
    assert torch.equal(padded, states.detach() * mask.unsqueeze(-1))
    padded.sum().backward()  # the gradient reaches only the kept tokens
    assert torch.equal(states.grad, mask.unsqueeze(-1).expand(2, 4, 3).float())


def test_unused_mask_counts_in_the_lengths_but_not_in_the_used_ones(flash_attn):
    from flash_attn.bert_padding import unpad_input
    mask = torch.tensor([[1, 1, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0]])
    _, indices, cu_seqlens, max_len, used = unpad_input(torch.zeros(1, 4, 2), mask, unused)
    assert indices.tolist() == [0, 1, 2] and cu_seqlens.tolist() == [0, 3] and max_len == 3 and used.tolist() == [2]


def test_all_gather_over_a_gloo_group_of_one_is_the_input(flash_attn, tmp_path):
    import torch.distributed as dist
    from flash_attn.utils.distributed import all_gather
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        x = torch.arange(6, dtype=torch.float32).reshape(3, 2).requires_grad_()
        out = all_gather(x, dist.group.WORLD)
        assert torch.equal(out, x.detach())
        out.sum().backward()
        assert torch.equal(x.grad, torch.ones(3, 2))
    finally:
        dist.destroy_process_group()


def test_the_attention_kernels_refuse_naming_cuda(flash_attn):
    with pytest.raises(flash_attn.FlashAttnNeedsCuda, match="flash-attn needs CUDA"):
        flash_attn.flash_attn_varlen_func(None, None, None)
    with pytest.raises(flash_attn.FlashAttnNeedsCuda, match="flash-attn needs CUDA"):
        flash_attn.flash_attn_func(None, None, None)
