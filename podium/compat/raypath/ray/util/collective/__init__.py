"""``ray.util.collective``: Ray's collective API on ``torch.distributed`` (gloo on CPU, NCCL
on GPU), with the rendezvous through Podium (see :mod:`podium.compat.collective`)."""

from __future__ import annotations

from podium.compat.collective import (
    allgather,
    allreduce,
    barrier,
    broadcast,
    create_collective_group,
    destroy_collective_group,
    get_collective_group_size,
    get_rank,
    init_collective_group,
    is_group_initialized,
    recv,
    send,
)
from podium.compat.standin import missing

__all__ = [
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "create_collective_group",
    "destroy_collective_group",
    "get_collective_group_size",
    "get_rank",
    "init_collective_group",
    "is_group_initialized",
    "recv",
    "send",
]


def __getattr__(name: str):
    return missing(f"ray.util.collective.{name}", "torch.distributed on the group podium.compat.collective made")
