"""The carrier protocol: how one weight update travels from a trainer rank to N replicas.

Every carrier has the same three steps, which :mod:`podium.rollout.weights.driver` runs:

1. **prepare**: each replica's :class:`ReceivingEnd` readies itself and returns metadata
   (a listening address and token, a group it is in, or just its name); the trainer's
   :class:`SendingEnd` then readies itself for those replicas (for a collective, it opens
   the rendezvous) and returns its own metadata;
2. :meth:`Carrier.routes` turns both into a route per end (the chain's downstream of each
   replica, a collective's rank, the post a bucket goes through);
3. **send** and **receive** run at once: the sending end moves the ``(name, tensor)`` pairs
   along its route, each receiving end returns the complete update, or raises (and hands
   over nothing) when the update failed.

The carriers (:func:`carrier_named`): ``"chain"`` (TCP, or shared-memory segments within a
host: :mod:`podium.rollout.weights.chain`), ``"nccl"`` / ``"gloo"`` (a collective group:
:mod:`podium.rollout.weights.collective`) and ``"refs"`` (buckets as Podium object
references: :mod:`podium.rollout.weights.refs`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from podium.errors import InvalidArgumentError

__all__ = ["SendingEnd", "ReceivingEnd", "Carrier", "CARRIER_NAMES", "carrier_named"]

#: The carriers a caller may name.
CARRIER_NAMES = ("chain", "nccl", "gloo", "refs")


class SendingEnd(Protocol):
    """The trainer rank's side of a carrier."""

    #: The largest bucket it sends, in bytes.
    bucket_bytes: int
    #: Seconds any one wait of an update may stall.
    timeout: float

    def prepare(self, receivers: list[dict]) -> dict:
        """Ready the next update for the replicas whose metadata is ``receivers``; this end's metadata."""

    def send(self, weights: Iterable[tuple[str, Any]], route: Any, step: int | None = None) -> dict:
        """Move every pair along ``route``; ``{"tensors", "bytes", "buckets"}``."""

    def close(self) -> None:
        """Release what the end holds (a group, a rendezvous)."""


class ReceivingEnd(Protocol):
    """A replica's side of a carrier."""

    #: Seconds any one wait of an update may stall.
    timeout: float
    #: Why the next replica along the route failed in the last update (None: it did not, or none).
    downstream_error: str | None

    def prepare(self) -> dict:
        """Ready the next update; the metadata routes are built from (``"name"`` among it)."""

    def receive(self, route: Any, step: int | None = None) -> list[tuple[str, Any]]:
        """The whole update's pairs, or an error (UnavailableError, DataLossError) and nothing."""

    def finalize(self) -> None:
        """End the update (close what only it needed)."""


class Carrier(Protocol):
    """Makes the two ends of one carrier and the routes between them."""

    name: str
    #: Whether the driver must call the sending end's ``prepare`` (the chain's is empty).
    sender_prepares: bool

    def sending_end(self, bucket_bytes: int, timeout: float) -> SendingEnd:
        """A new sending end."""

    def receiving_end(self, name: str, timeout: float) -> ReceivingEnd:
        """A new receiving end for the replica called ``name``."""

    def routes(self, sender: dict, receivers: list[dict]) -> tuple[Any, list[Any]]:
        """The sending end's route and each receiving end's, from their metadata."""


def carrier_named(name: Any) -> Carrier:
    """The carrier called ``name`` (one of :data:`CARRIER_NAMES`); InvalidArgumentError otherwise."""
    if name == "chain":
        from podium.rollout.weights.chain import ChainCarrier

        return ChainCarrier()
    if name in ("nccl", "gloo"):
        from podium.rollout.weights.collective import CollectiveCarrier

        return CollectiveCarrier(name)
    if name == "refs":
        from podium.rollout.weights.refs import RefsCarrier

        return RefsCarrier()
    raise InvalidArgumentError(f"carrier must be one of {CARRIER_NAMES}, got {name!r}")
