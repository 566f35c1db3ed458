"""The chain carrier: a pipelined TCP chain through the replicas, shared-memory segments
within a host. The wire itself is :mod:`podium.rollout.broadcast` (with
:mod:`podium.rollout.broadcastshm` and the token check of :mod:`podium.rollout.broadcastdoor`):
its :class:`~podium.rollout.broadcast.WeightSender` and
:class:`~podium.rollout.broadcast.WeightReceiver` are this carrier's two ends as they are.
"""

from __future__ import annotations

from typing import Any

from podium.rollout.broadcast import WeightReceiver, WeightSender, build_topology

__all__ = ["ChainCarrier"]


class ChainCarrier:
    """Routes: the sender's is the chain's head, each replica's the one after it (None: last)."""

    name = "chain"
    sender_prepares = False

    def sending_end(self, bucket_bytes: int, timeout: float) -> WeightSender:
        """A :class:`WeightSender`."""
        return WeightSender(bucket_bytes, timeout)

    def receiving_end(self, name: str, timeout: float) -> WeightReceiver:
        """A :class:`WeightReceiver` listening on this node's address."""
        return WeightReceiver(name=name, timeout=timeout)

    def routes(self, sender: dict, receivers: list[dict]) -> tuple[Any, list[Any]]:
        """The chain in the order of ``receivers``."""
        return build_topology(receivers)
