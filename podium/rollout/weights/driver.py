"""The one driver of a weight update, over any carrier and any way of reaching the replicas.

:func:`drive_update` runs the carrier protocol (:mod:`podium.rollout.weights.carrier`) from
the controller: prepare every replica, prepare the sender (when the carrier needs it),
build the routes, start every replica's receive (``blocking=False``: they run at once),
send, then wait for each replica's outcome. The data never passes through the controller.
:func:`podium.rollout.broadcastgroups.broadcast_weights` (replicas a worker group) and
:class:`~podium.rollout.servermanager.RolloutServerManager` (replicas actors) both call it
with a :class:`Replicas` and a :class:`Source` of their own.

:meth:`UpdateOutcome.conclude` turns the outcomes into the update's summary, or a
:class:`~podium.errors.WeightBroadcastError` that names the failed replicas and says
which hold the new weights and which kept their previous ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podium.errors import PodiumError, WeightBroadcastError
from podium.rollout.weights.carrier import carrier_named

__all__ = ["Replicas", "Source", "UpdateOutcome", "drive_update", "conclude_broadcast"]


@dataclass
class Replicas:
    """How the driver reaches the replicas: ``prepare(carrier, timeout)`` answers each one's
    metadata; ``receive(carrier, routes, step)`` starts each one's receive and answers a
    pending result per replica (anything with ``get(timeout=...)``)."""

    prepare: Callable[[str, float], list[dict]]
    receive: Callable[[str, list, int | None], list]


@dataclass
class Source:
    """How the driver reaches the trainer rank: ``send(carrier, route, step)`` answers the
    sent summary; ``prepare(carrier, receivers)`` (needed by carriers whose sender prepares)
    answers the sender's metadata."""

    send: Callable[[str, Any, int | None], Any]
    prepare: Callable[[str, list[dict]], Any] | None = None


@dataclass
class UpdateOutcome:
    """What each replica and the sender ended with."""

    names: list[str]
    outcomes: list = field(default_factory=list)
    sent: dict | None = None
    send_error: BaseException | None = None
    step: int | None = None
    start: float = 0.0

    def updated(self) -> list[str]:
        """The replicas whose own copy of the update completed."""
        return [name for name, out in zip(self.names, self.outcomes) if isinstance(out, dict)]

    def conclude(self) -> dict:
        """The summary, or WeightBroadcastError (see :func:`conclude_broadcast`)."""
        return conclude_broadcast(self.names, self.outcomes, self.sent, self.send_error, self.step, self.start)


def drive_update(carrier: str, replicas: Replicas, source: Source, step: int | None, timeout: float) -> UpdateOutcome:
    """One update over ``carrier``; each replica's outcome (its receive's dict, or the error
    it ended with) and the sender's. ``timeout`` bounds each stall of the stream; a receive
    is waited for at most one timeout per replica behind it, plus three."""
    kind = carrier_named(carrier)
    start = time.monotonic()
    metadata = list(replicas.prepare(carrier, timeout))
    sender_meta: dict = {}
    if kind.sender_prepares:
        if source.prepare is None:
            from podium.errors import InvalidArgumentError

            raise InvalidArgumentError(f"the {carrier} carrier needs a source that prepares (broadcast_open)")
        sender_meta = _first(source.prepare(carrier, metadata))
    route, routes = kind.routes(sender_meta, metadata)
    pending = replicas.receive(carrier, routes, step)
    outcome = UpdateOutcome([str(m.get("name", i)) for i, m in enumerate(metadata)], step=step, start=start)
    try:
        outcome.sent = _first(source.send(carrier, route, step))
    except PodiumError as exc:
        outcome.send_error = exc
    deadline = timeout * (3 + len(metadata))
    for ref in pending:
        try:
            outcome.outcomes.append(ref.get(timeout=deadline))
        except PodiumError as exc:
            outcome.outcomes.append(exc)
    return outcome


def conclude_broadcast(names: list[str], outcomes: list, sent: dict | None, send_error: BaseException | None,
                       step: int | None, start: float) -> dict:
    """The result of one update from each replica's outcome and the sender's: the summary
    (``{"bytes", "tensors", "buckets", "seconds", "MBps", "replicas"}``), or
    :class:`WeightBroadcastError` naming the failed replicas and which kept their weights."""
    updated = [name for name, out in zip(names, outcomes) if isinstance(out, dict)]
    failed = {name: str(out) for name, out in zip(names, outcomes) if not isinstance(out, dict)}
    for out in outcomes:  # a replica that lost its downstream says so; the downstream's own error may be vaguer
        if isinstance(out, dict) and out.get("downstream_error"):
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
    # The error text starts "replica NAME at host:port ..." (the chain's forwarder).
    for name in names:
        if error.startswith(f"replica {name} at "):
            return name
    return error.split(" at ")[0]


def _first(result: Any) -> Any:
    # A RANK_ZERO call answers rank 0's value alone or in a one-item list.
    return result[0] if isinstance(result, (list, tuple)) else result
