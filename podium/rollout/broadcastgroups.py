"""Weight broadcast over worker groups: the roles' registered methods and the driver.

A trainer role mixes in :class:`BroadcastSource` (rank 0 sends its weights), a replica role
:class:`BroadcastTarget` (every rank is one replica); :func:`broadcast_weights` runs one
update from the controller: prepare the replicas, build the chain, receive everywhere
(``blocking=False``), send, then settle every replica. The data never passes through the
controller. A replica that dies or stalls fails the update with :class:`WeightBroadcastError`,
which says which replicas hold the new weights and which kept their previous ones.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from podium.errors import InvalidArgumentError, PodiumError, WeightBroadcastError
from podium.rollout.broadcast import (
    DEFAULT_BUCKET_BYTES,
    WeightReceiver,
    WeightSender,
    build_topology,
)
from podium.rollout.weights import state_dict_of
from podium.worker.decorator import Dispatch, Execute, register

__all__ = ["BroadcastSource", "BroadcastTarget", "broadcast_weights", "conclude_broadcast"]


class BroadcastSource:
    """Mixin for a trainer role: ``broadcast_send`` streams rank 0's weights to a chain head.

    The weights are :meth:`broadcast_weights_iter` (the role's state dict by default;
    override it to yield ``(name, tensor)`` pairs gathered from shards)."""

    def broadcast_weights_iter(self) -> Iterable[tuple[str, Any]]:
        """The ``(name, tensor)`` pairs to send: the role's state dict, in order."""
        return state_dict_of(self).items()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def broadcast_send(self, head: dict, step: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       timeout: float = 120.0) -> dict:
        """Send this rank's weights to the replica ``head``; ``{"tensors", "bytes", "buckets"}``."""
        return WeightSender(bucket_bytes, timeout).send(self.broadcast_weights_iter(), head, step)


class BroadcastTarget:
    """Mixin for a replica role: each rank receives, forwards down the chain, then loads.

    :meth:`load_broadcast_weights` copies the pairs into the role's state dict by default;
    a rollout engine overrides it with its own loader."""

    def load_broadcast_weights(self, pairs: list[tuple[str, Any]]) -> None:
        """Load a complete update: copy each tensor into the state dict entry of its name."""
        import torch

        state = state_dict_of(self)
        unknown = [name for name, _ in pairs if name not in state]
        if unknown:
            raise InvalidArgumentError(f"weights this replica does not have: {unknown[:5]}")
        with torch.no_grad():
            for name, tensor in pairs:
                state[name].copy_(tensor)

    def _broadcast_receiver(self) -> WeightReceiver:
        receiver = getattr(self, "_podium_receiver", None)
        if receiver is None:
            name = f"rank {getattr(self, 'rank', '?')} (pid {__import__('os').getpid()})"
            receiver = self._podium_receiver = WeightReceiver(name=name)
        return receiver

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def broadcast_prepare(self, timeout: float = 120.0) -> dict:
        """Listen for the next update; the metadata the chain is built from."""
        receiver = self._broadcast_receiver()
        receiver.timeout = timeout
        return receiver.prepare()

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, blocking=False)
    def broadcast_receive(self, downstream: dict | None, step: int | None = None) -> dict:
        """Receive one update, forward it to ``downstream``, load it; what happened here."""
        receiver = self._broadcast_receiver()
        start = time.monotonic()
        pairs = receiver.receive(downstream, step)
        received = time.monotonic() - start
        self.load_broadcast_weights(pairs)
        return {"replica": receiver.name, "tensors": len(pairs), "receive_s": received,
                "load_s": time.monotonic() - start - received, "downstream_error": receiver.downstream_error}


def broadcast_weights(source: Any, replicas: Any, step: int | None = None,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float = 120.0) -> dict:
    """One weight update from ``source`` rank 0 to every rank of ``replicas`` (a group or role
    view whose role mixes in :class:`BroadcastTarget`), along a chain in rank order.

    ``timeout`` bounds each stall of the stream (a hung replica costs about that much).
    Returns ``{"bytes", "tensors", "buckets", "seconds", "MBps", "replicas"}``. Raises
    :class:`WeightBroadcastError` when a replica failed: its ``failed`` names them and why,
    ``updated`` and ``kept`` list the replicas holding the new and the previous weights."""
    start = time.monotonic()
    metadata = list(replicas.broadcast_prepare(timeout=timeout))
    head, downstreams = build_topology(metadata)
    # Every argument a list of one item per rank: the ALL_TO_ALL rule slices them.
    pending = replicas.broadcast_receive(downstreams, step=[step] * len(metadata))
    sent: dict | None = None
    send_error: BaseException | None = None
    try:
        sent = _first(source.broadcast_send(head, step=step, bucket_bytes=bucket_bytes, timeout=timeout))
    except PodiumError as exc:
        send_error = exc
    # Each receive ends within its own deadlines (a stall costs one timeout per replica behind it).
    deadline = timeout * (3 + len(metadata))
    outcomes: list[dict | BaseException] = []
    for ref in _refs(pending):
        try:
            outcomes.append(ref.get(timeout=deadline))
        except PodiumError as exc:
            outcomes.append(exc)
    return conclude_broadcast([m["name"] for m in metadata], outcomes, sent, send_error, step, start)


def conclude_broadcast(names: list[str], outcomes: list, sent: dict | None, send_error: BaseException | None,
                       step: int | None, start: float) -> dict:
    """The result of one update from each replica's outcome (its ``broadcast_receive`` dict,
    or the error it ended with) and the sender's: the summary :func:`broadcast_weights`
    returns, or :class:`WeightBroadcastError` naming the failed replicas and which kept
    their weights. Shared by drivers over worker groups and over actors."""
    updated = [name for name, out in zip(names, outcomes) if isinstance(out, dict)]
    failed = {name: str(out) for name, out in zip(names, outcomes) if not isinstance(out, dict)}
    for out in outcomes:  # a replica that lost its downstream says so; the downstream's own error may be vaguer
        if isinstance(out, dict) and out["downstream_error"]:
            failed.setdefault(_downstream_name(out["downstream_error"], names), out["downstream_error"])
    if failed or send_error is not None:
        if send_error is not None and not failed:
            failed["sender"] = str(send_error)
        kept = [name for name in names if name not in updated]
        raise WeightBroadcastError(
            f"weight update {step if step is not None else ''} failed at {', '.join(failed)}: "
            + "; ".join(f"{k}: {v}" for k, v in failed.items())
            + f". New weights on {updated or 'none'}; previous weights kept on {kept or 'none'}.",
            failed=failed, updated=updated, kept=kept)
    seconds = time.monotonic() - start
    assert sent is not None
    return {**sent, "seconds": seconds, "MBps": sent["bytes"] / 1e6 / max(seconds, 1e-9), "replicas": len(names)}


def _downstream_name(error: str, names: list[str]) -> str:
    # The error text starts "replica NAME at host:port ..." (broadcast._Forward).
    for name in names:
        if error.startswith(f"replica {name} at "):
            return name
    return error.split(" at ")[0]


def _first(result: Any) -> Any:
    return result[0] if isinstance(result, (list, tuple)) else result


def _refs(pending: Any) -> list:
    return list(pending) if isinstance(pending, (list, tuple)) else [pending]
