"""Registered methods that put a role's endpoint on the worker-group surface.

:class:`BroadcastSource`, :class:`BroadcastTarget` and :class:`WeightSource` keep the names
roles inherited before the endpoints existed: each is a few registered methods that only
delegate to the role's :class:`~podium.rollout.weights.endpoint.WeightOutlet` or
:class:`~podium.rollout.weights.endpoint.WeightEndpoint` (:func:`outlet_of`,
:func:`endpoint_of`), where the work is done.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from podium.rollout.weights.endpoint import WeightEndpoint, WeightOutlet
from podium.rollout.weights.plan import DEFAULT_BUCKET_BYTES, state_dict_of
from podium.worker.decorator import Dispatch, Execute, register

__all__ = ["BroadcastSource", "BroadcastTarget", "WeightSource", "outlet_of", "endpoint_of", "load_into_state"]


def outlet_of(role: Any) -> WeightOutlet:
    """The role's sending endpoint, made on first use over ``role.broadcast_weights_iter()``
    (when it has one) or its state dict."""
    outlet = role.__dict__.get("_podium_weights_out")
    if outlet is None:
        source = getattr(role, "broadcast_weights_iter", None)
        outlet = role._podium_weights_out = WeightOutlet(source or (lambda: state_dict_of(role).items()))
    return outlet


def endpoint_of(role: Any) -> WeightEndpoint:
    """The role's receiving endpoint, made on first use; it loads with
    ``role.load_broadcast_weights`` (when it has one) or into its state dict."""
    endpoint = role.__dict__.get("_podium_weights_in")
    if endpoint is None:
        load = getattr(role, "load_broadcast_weights", None) or (lambda pairs: load_into_state(role, pairs))
        name = f"rank {getattr(role, 'rank', '?')} (pid {os.getpid()})"
        endpoint = role._podium_weights_in = WeightEndpoint(name, load)
    return endpoint


def load_into_state(role: Any, pairs: list[tuple[str, Any]]) -> None:
    """Copy each tensor into the entry of the role's state dict of its name."""
    import torch

    from podium.errors import InvalidArgumentError

    state = state_dict_of(role)
    unknown = [name for name, _ in pairs if name not in state]
    if unknown:
        raise InvalidArgumentError(f"weights this replica does not have: {unknown[:5]}")
    with torch.no_grad():
        for name, tensor in pairs:
            state[name].copy_(tensor)


class BroadcastSource:
    """A trainer role's broadcast methods: rank 0 sends (override ``broadcast_weights_iter``
    to yield ``(name, tensor)`` pairs gathered from shards)."""

    def broadcast_weights_iter(self) -> Iterable[tuple[str, Any]]:
        """The ``(name, tensor)`` pairs to send: the role's state dict, in order."""
        return state_dict_of(self).items()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def broadcast_open(self, receivers: list[dict], carrier: str = "nccl", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       timeout: float = 120.0) -> dict:
        """Ready an update for ``receivers`` (a collective's rendezvous); the sender's metadata."""
        return outlet_of(self).prepare(receivers, carrier, bucket_bytes, timeout)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def broadcast_send(self, head: Any, step: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       timeout: float = 120.0, carrier: str = "chain") -> dict:
        """Send this rank's weights along ``head`` (the chain's first replica); ``{"tensors", "bytes", "buckets"}``."""
        return outlet_of(self).send(head, step, carrier, bucket_bytes, timeout)


class BroadcastTarget:
    """A replica role's broadcast methods: each rank receives, forwards, then loads (override
    ``load_broadcast_weights(pairs)`` with an engine's own loader)."""

    def load_broadcast_weights(self, pairs: list[tuple[str, Any]]) -> None:
        """Load a complete update: copy each tensor into the state dict entry of its name."""
        load_into_state(self, pairs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def broadcast_prepare(self, timeout: float = 120.0, carrier: str = "chain") -> dict:
        """Ready the next update; the metadata the routes are built from."""
        return endpoint_of(self).prepare(carrier, timeout)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, blocking=False)
    def broadcast_receive(self, downstream: Any, step: int | None = None, carrier: str = "chain") -> dict:
        """Receive one update along ``downstream``, load it; what happened here."""
        return endpoint_of(self).receive(downstream, step, carrier)


class WeightSource:
    """An actor role's refs-carrier methods: a rollout in ANOTHER process fetches the buckets
    (``rollout_weight_bucket`` is ``blocking=False``: each stays in this worker; see
    :func:`podium.rollout.sync.push_weights`)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def rollout_weight_plan(self, bucket_bytes: int) -> int:
        """Plan buckets of at most ``bucket_bytes`` over the current weights; their count."""
        return outlet_of(self).plan(bucket_bytes)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO, blocking=False)
    def rollout_weight_bucket(self, index: int) -> dict:
        """Bucket ``index`` of the last plan: ``{name: detached tensor}``."""
        return outlet_of(self).bucket(index)


