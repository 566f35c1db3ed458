"""flash-attn's ``all_gather`` (``flash_attn/utils/distributed.py``), in plain ``torch.distributed``.

It gathers each rank's tensor along the first axis, and its backward pass reduce-scatters the
gradient; nothing in it needs CUDA (any backend with ``all_gather_into_tensor`` runs it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather"]


class _AllGather(torch.autograd.Function):
    """Gather along the first axis; the gradient is reduce-scattered back to each rank."""

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, process_group: Any) -> torch.Tensor:  # noqa: D102
        ctx.process_group = process_group
        world = dist.get_world_size(process_group)
        output = torch.empty(world * input_.shape[0], *input_.shape[1:], dtype=input_.dtype, device=input_.device)
        dist.all_gather_into_tensor(output, input_.contiguous(), group=process_group)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        world = dist.get_world_size(ctx.process_group)
        grad_input = torch.empty(grad_output.shape[0] // world, *grad_output.shape[1:], dtype=grad_output.dtype,
                                 device=grad_output.device)
        dist.reduce_scatter_tensor(grad_input, grad_output.contiguous(), group=ctx.process_group)
        return grad_input, None


def all_gather(input_: torch.Tensor, process_group: Any) -> torch.Tensor:
    """Each rank's ``input_`` concatenated along the first axis, in rank order."""
    return _AllGather.apply(input_, process_group)
