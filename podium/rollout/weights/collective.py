"""The collective carrier: one process group of the trainer rank and the replicas, NCCL
between GPUs (tensors stay on the device), gloo on CPUs. The wire is
:mod:`podium.rollout.broadcastcollective`; these ends fit it to the carrier protocol.

The group outlives an update (NCCL communicators are slow to make): the sending end opens
a new one only when the replicas changed (another count, or one not in its group: a
replacement, or one whose group broke), and each receiving end joins the group its route
names when it is not already in it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from podium.rollout.broadcastcollective import CollectiveReceiver, CollectiveSender
from podium.rollout.weights.plan import check_timeout

__all__ = ["CollectiveCarrier", "CollectiveSendingEnd", "CollectiveReceivingEnd"]


class CollectiveSendingEnd:
    """Rank 0 of the group: a :class:`CollectiveSender`, remade when the replicas change."""

    def __init__(self, bucket_bytes: int, timeout: float, backend: str) -> None:
        self.bucket_bytes, self.timeout, self.backend = bucket_bytes, check_timeout(timeout), backend
        self._sender: CollectiveSender | None = None
        self._meta: dict = {}

    def prepare(self, receivers: list[dict]) -> dict:
        """The group's rendezvous; a new one unless every receiver is in the current group."""
        token = self._meta.get("token")
        if self._sender is None or self._sender.replicas != len(receivers) or \
                any(r.get("group") != token for r in receivers):
            self.close()
            self._sender = CollectiveSender(len(receivers), self.bucket_bytes, self.timeout, self.backend)
            self._meta = self._sender.prepare()
        return dict(self._meta)

    def send(self, weights: Iterable[tuple[str, Any]], route: Any, step: int | None = None) -> dict:
        """Broadcast every pair to the group (the route is the group itself)."""
        from podium.errors import InvalidArgumentError

        if self._sender is None:
            raise InvalidArgumentError("weight broadcast: send before prepare")
        try:
            return self._sender.send(weights, step)
        except BaseException:
            if not self._sender_alive():
                self._meta = {}  # the group broke: the next prepare opens a new one
            raise

    def _sender_alive(self) -> bool:
        return self._sender is not None and self._sender.ready

    def close(self) -> None:
        """Leave the group and close the rendezvous."""
        sender, self._sender, self._meta = self._sender, None, {}
        if sender is not None:
            sender.close()


class CollectiveReceivingEnd:
    """Rank 1..N: joins the group its route names (once), then takes each update."""

    downstream_error: str | None = None  # a collective has no downstream

    def __init__(self, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = check_timeout(timeout)
        self._receiver = CollectiveReceiver(name=name, timeout=timeout)
        self._token = ""

    def prepare(self) -> dict:
        """This replica's name and the group it is in ("" when none)."""
        return {"name": self.name, "group": self._token if self._receiver.joined else ""}

    def receive(self, route: Any, step: int | None = None) -> list[tuple[str, Any]]:
        """Join ``route``'s group when not in it, then the update's pairs."""
        self._receiver.timeout = self.timeout
        if not self._receiver.joined or route.get("token") != self._token:
            self._token = ""
            self._receiver.join(route, route.get("rank", 0))
            self._token = str(route.get("token"))
        return self._receiver.receive(step)

    def finalize(self) -> None:
        """Nothing to close: the group stays for the next update."""


class CollectiveCarrier:
    """Routes: every replica gets the rendezvous and its rank (1..N, in order)."""

    sender_prepares = True

    def __init__(self, backend: str = "nccl") -> None:
        self.name = backend
        self.backend = backend

    def sending_end(self, bucket_bytes: int, timeout: float) -> CollectiveSendingEnd:
        """A sending end over ``backend`` (NCCL falls back to gloo where no GPU is visible)."""
        return CollectiveSendingEnd(bucket_bytes, timeout, self.backend)

    def receiving_end(self, name: str, timeout: float) -> CollectiveReceivingEnd:
        """A receiving end."""
        return CollectiveReceivingEnd(name, timeout)

    def routes(self, sender: dict, receivers: list[dict]) -> tuple[Any, list[Any]]:
        """``(None, [rendezvous with rank i + 1 for replica i])``."""
        return None, [dict(sender, rank=i + 1) for i in range(len(receivers))]
