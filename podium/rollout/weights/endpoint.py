"""The two endpoints a role composes: :class:`WeightEndpoint` receives updates into a
replica, :class:`WeightOutlet` sends a trainer rank's weights.

A :class:`~podium.rollout.server.RolloutServer`, a :class:`~podium.rollout.vllm.VLLMRollout`
and any role that takes weights hold one :class:`WeightEndpoint`, built with the function
that loads a complete update into them; a trainer role holds one :class:`WeightOutlet`,
built with the function that yields its weights. Each keeps one end per carrier it was
asked for (a collective's group, a chain's staging buffers, outlive an update).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from podium.errors import InvalidArgumentError
from podium.rollout.weights.carrier import ReceivingEnd, SendingEnd, carrier_named
from podium.rollout.weights.plan import DEFAULT_BUCKET_BYTES, check_bucket_bytes, check_timeout
from podium.rollout.weights.refs import RefsReceivingEnd, RefsSendingEnd

__all__ = ["WeightEndpoint", "WeightOutlet"]


class WeightEndpoint:
    """A replica's receiving side: ``prepare`` / ``receive`` per carrier, then ``load``.

    ``load(pairs)`` loads a complete update; ``check(pairs, complete)`` (optional) checks
    names and shapes of staged buckets (the refs carrier's :meth:`stage`)."""

    def __init__(self, name: str, load: Callable[[list[tuple[str, Any]]], Any],
                 check: Callable[[Iterable[tuple[str, Any]], bool], list] | None = None) -> None:
        self.name = name
        self._load = load
        self._ends: dict[str, ReceivingEnd] = {}
        self.refs = RefsReceivingEnd(name, check=check)
        #: The carrier of the last update prepared, and why its downstream failed.
        self.last_carrier = ""
        self.downstream_error: str | None = None

    def _end(self, carrier: str) -> ReceivingEnd:
        end = self._ends.get(carrier)
        if end is None:
            end = self.refs if carrier == "refs" else carrier_named(carrier).receiving_end(self.name, 120.0)
            self._ends[carrier] = end
        return end

    def prepare(self, carrier: str = "chain", timeout: float = 120.0) -> dict:
        """Ready the next update over ``carrier``; the metadata its routes are built from."""
        end = self._end(carrier)
        end.timeout = check_timeout(timeout)
        self.last_carrier = carrier
        return end.prepare()

    def receive(self, route: Any, step: int | None = None, carrier: str = "chain") -> dict:
        """Receive one update along ``route`` and load it; ``{"replica", "tensors",
        "receive_s", "load_s", "downstream_error"}``. Nothing is loaded when it failed."""
        end = self._ends.get(carrier)
        if end is None:
            raise InvalidArgumentError(f"weight update: receive over {carrier!r} before prepare")
        start = time.monotonic()
        pairs = end.receive(route, step)
        received = time.monotonic() - start
        self._load(pairs)
        self.downstream_error = end.downstream_error
        return {"replica": self.name, "tensors": len(pairs), "receive_s": received,
                "load_s": time.monotonic() - start - received, "downstream_error": end.downstream_error}

    def stage(self, bucket: Mapping[str, Any], finish: bool) -> list[tuple[str, Any]] | None:
        """One bucket of a refs update (see :meth:`RefsReceivingEnd.stage`)."""
        return self.refs.stage(bucket, finish)

    def finalize(self) -> None:
        """End the update on every carrier (a chain's listener closes)."""
        for end in self._ends.values():
            end.finalize()


class WeightOutlet:
    """A trainer rank's sending side: ``prepare`` / ``send`` per carrier over ``weights()``,
    and the refs carrier's ``plan`` / ``bucket``."""

    def __init__(self, weights: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self._weights = weights
        self._ends: dict[str, SendingEnd] = {}
        self.refs: RefsSendingEnd | None = None

    def _end(self, carrier: str, bucket_bytes: int, timeout: float) -> SendingEnd:
        end = self._ends.get(carrier)
        if end is None or end.bucket_bytes != bucket_bytes:
            if end is not None:
                end.close()
            end = self._ends[carrier] = carrier_named(carrier).sending_end(bucket_bytes, timeout)
        end.timeout = check_timeout(timeout)
        return end

    def prepare(self, receivers: list[dict], carrier: str = "chain", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                timeout: float = 120.0) -> dict:
        """Ready the next update for ``receivers``; the sender's metadata."""
        return self._end(carrier, check_bucket_bytes(bucket_bytes), timeout).prepare(receivers)

    def send(self, route: Any, step: int | None = None, carrier: str = "chain",
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float = 120.0) -> dict:
        """Send the weights along ``route``; ``{"tensors", "bytes", "buckets"}``."""
        return self._end(carrier, check_bucket_bytes(bucket_bytes), timeout).send(self._weights(), route, step)

    def plan(self, bucket_bytes: int) -> int:
        """Plan refs buckets of at most ``bucket_bytes`` over the current weights; their count."""
        self.refs = RefsSendingEnd(bucket_bytes)
        return self.refs.plan(dict(self._weights()))

    def bucket(self, index: int) -> dict:
        """Refs bucket ``index`` of the last plan."""
        if self.refs is None:
            raise InvalidArgumentError("rollout_weight_bucket before rollout_weight_plan")
        return self.refs.bucket(index)

    def close(self) -> None:
        """Close every carrier's end (a collective's group and rendezvous)."""
        for end in self._ends.values():
            end.close()
        self._ends = {}
