"""Weight broadcast over worker groups: :func:`broadcast_weights`, the driver's group face.

A trainer role inherits :class:`BroadcastSource` (rank 0 sends its weights), a replica role
:class:`BroadcastTarget` (every rank is one replica): registered methods over the endpoints
of :mod:`podium.rollout.weights`. :func:`broadcast_weights` runs one update from the
controller with :func:`~podium.rollout.weights.driver.drive_update`, over any carrier. The
data never passes through the controller. A replica that dies or stalls fails the update
with :class:`~podium.errors.WeightBroadcastError`, which says which replicas hold the new
weights and which kept their previous ones.
"""

from __future__ import annotations

from typing import Any

from podium.rollout.weights.driver import Replicas, Source, conclude_broadcast, drive_update
from podium.rollout.weights.plan import DEFAULT_BUCKET_BYTES
from podium.rollout.weights.roles import BroadcastSource, BroadcastTarget

__all__ = ["BroadcastSource", "BroadcastTarget", "broadcast_weights", "conclude_broadcast"]


def broadcast_weights(source: Any, replicas: Any, step: int | None = None,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float = 120.0,
                      carrier: str = "chain") -> dict:
    """One weight update from ``source`` rank 0 to every rank of ``replicas`` (a group or role
    view whose role inherits :class:`BroadcastTarget`), over ``carrier`` (``"chain"``: along a
    chain in rank order; ``"nccl"`` / ``"gloo"``: one collective group).

    ``timeout`` bounds each stall of the stream (a hung replica costs about that much).
    Returns ``{"bytes", "tensors", "buckets", "seconds", "MBps", "replicas"}``. Raises
    :class:`WeightBroadcastError` when a replica failed: its ``failed`` names them and why,
    ``updated`` and ``kept`` list the replicas holding the new and the previous weights."""
    extra = {} if carrier == "chain" else {"carrier": carrier}  # a hand-written source may not take it

    def receive(kind: str, routes: list, step: int | None) -> list:
        # Every argument a list of one item per rank: the ALL_TO_ALL rule slices them.
        pending = replicas.broadcast_receive(routes, step=[step] * len(routes),
                                             **{k: [v] * len(routes) for k, v in extra.items()})
        return list(pending) if isinstance(pending, (list, tuple)) else [pending]

    group = Replicas(prepare=lambda kind, t: list(replicas.broadcast_prepare(timeout=t, **extra)), receive=receive)
    sender = Source(send=lambda kind, route, step: source.broadcast_send(route, step=step, bucket_bytes=bucket_bytes,
                                                                         timeout=timeout, **extra),
                    prepare=lambda kind, receivers: source.broadcast_open(receivers, carrier=kind,
                                                                          bucket_bytes=bucket_bytes, timeout=timeout))
    return drive_update(carrier, group, sender, step, timeout).conclude()
