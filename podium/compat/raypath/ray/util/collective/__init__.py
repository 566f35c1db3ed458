"""``ray.util.collective``: Ray's collective API on ``torch.distributed`` (gloo on CPU, NCCL
on GPU), with the rendezvous through Podium (see :mod:`podium.compat.collective`)."""

from __future__ import annotations

from podium.compat import collective as _collective
from podium.compat.collective import *  # noqa: F403 - the whole API, under Ray's names
from podium.compat.standin import missing

__all__ = list(_collective.__all__)


def __getattr__(name: str):
    return missing(f"ray.util.collective.{name}", "torch.distributed on the group podium.compat.collective made")
