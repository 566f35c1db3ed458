"""The refs carrier: buckets as Podium object references, for a rollout in another process
that is not a broadcast replica (:func:`podium.rollout.sync.push_weights`).

The sending end plans buckets of at most ``bucket_bytes`` and hands out one at a time;
the receiving end stages them and hands the update over only once the last one came and
the whole set checked out. Between processes the route is Podium's own data path: the
trainer holds each bucket as the result of a ``blocking=False`` call and the rollout's
worker fetches it from there (push_weights drives it, two buckets held at most). Within
one process the route is a :class:`BucketPost`, as the carrier contract test uses it.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from podium.errors import DataLossError, InvalidArgumentError, UnavailableError
from podium.rollout.weights.plan import DEFAULT_BUCKET_BYTES, check_bucket_bytes, check_timeout, plan_buckets

__all__ = ["RefsCarrier", "RefsSendingEnd", "RefsReceivingEnd", "BucketPost"]

#: Buckets a post holds per receiver before the sender waits: the next one is prepared
#: while the receiver takes the current one.
_HELD = 2


def _pairs_checked(pairs: Iterable[tuple[str, Any]], complete: bool) -> list[tuple[str, Any]]:
    import torch

    items = []
    for name, tensor in pairs:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"weights must be (str, torch.Tensor) pairs, got "
                                       f"({type(name).__name__}, {type(tensor).__name__})")
        items.append((name, tensor.detach()))
    return items


class BucketPost:
    """The in-process route of the refs carrier: one bounded queue per receiver."""

    def __init__(self, receivers: int, timeout: float) -> None:
        self.timeout = check_timeout(timeout)
        self.boxes: list[queue.Queue] = [queue.Queue(_HELD) for _ in range(receivers)]

    def put(self, message: dict) -> None:
        """Give every receiver ``message`` (UnavailableError when one took nothing for a timeout)."""
        for i, box in enumerate(self.boxes):
            try:
                box.put(message, timeout=self.timeout)
            except queue.Full:
                raise UnavailableError(f"weight update: receiver {i} took no bucket for {self.timeout:g} s") from None


class RefsSendingEnd:
    """Plans buckets over a state dict and hands them out one at a time."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float = 120.0) -> None:
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self.timeout = check_timeout(timeout)
        self._state: Mapping[str, Any] = {}
        self._plan: list[list[str]] | None = None

    def prepare(self, receivers: list[dict] | None = None) -> dict:
        """Nothing to ready before the weights are known."""
        return {}

    def plan(self, state: Mapping[str, Any]) -> int:
        """Fix the buckets over ``state`` (by reference: no copy); their count."""
        self._state = state
        self._plan = plan_buckets(state, self.bucket_bytes)
        return len(self._plan)

    def bucket(self, index: Any) -> dict:
        """Bucket ``index`` of the last plan: ``{name: detached tensor}``."""
        if self._plan is None:
            raise InvalidArgumentError("a weight bucket asked for before the plan")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self._plan):
            raise InvalidArgumentError(f"bucket index {index!r} is not in [0, {len(self._plan)})")
        return {name: self._state[name].detach() for name in self._plan[index]}

    def send(self, weights: Iterable[tuple[str, Any]], route: BucketPost, step: int | None = None) -> dict:
        """Every bucket through ``route``; ``{"tensors", "bytes", "buckets"}``."""
        total = tensors = 0
        try:
            count = self.plan(dict(_pairs_checked(weights, complete=True)))
            for index in range(count):
                bucket = self.bucket(index)
                tensors += len(bucket)
                total += sum(t.numel() * t.element_size() for t in bucket.values())
                route.put({"bucket": bucket, "last": index + 1 == count, "step": step})
        except BaseException as exc:
            route.put({"failed": str(exc) or type(exc).__name__})
            raise
        return {"tensors": tensors, "bytes": total, "buckets": count}

    def close(self) -> None:
        """Forget the plan (the state dict is not held past it)."""
        self._state, self._plan = {}, None


class RefsReceivingEnd:
    """Stages buckets; the update once the last one came and the whole set checked out.

    ``check(pairs, complete)`` checks names and shapes (a rollout engine passes its model
    table); by default only the pairs' types are checked."""

    downstream_error: str | None = None  # buckets come from the trainer, never forwarded

    def __init__(self, name: str = "", timeout: float = 120.0,
                 check: Callable[[Iterable[tuple[str, Any]], bool], list] | None = None) -> None:
        self.name = name
        self.timeout = check_timeout(timeout)
        self._check = check or _pairs_checked
        self._staged: list[tuple[str, Any]] = []

    def prepare(self) -> dict:
        """Drop a half-staged update; this replica's name."""
        self._staged = []
        return {"name": self.name, "timeout": self.timeout}

    def stage(self, bucket: Any, finish: bool) -> list[tuple[str, Any]] | None:
        """Add one bucket (``{name: tensor}``); with ``finish``, the whole update (checked
        complete), else None. A bad bucket drops the stage: the next update starts afresh."""
        try:
            if not isinstance(bucket, Mapping):
                raise InvalidArgumentError(f"a weight bucket must hold a dict of name -> tensor, "
                                           f"got {type(bucket).__name__}")
            twice = sorted({name for name, _ in self._staged}.intersection(bucket))
            if twice:
                raise InvalidArgumentError(f"weights {twice[:5]} came in two buckets of one sync")
            self._staged.extend(self._check(bucket.items(), False))
            if not finish:
                return None
            items, self._staged = self._check(self._staged, True), []
            return items
        except BaseException:
            self._staged = []
            raise

    @property
    def staged(self) -> int:
        """Tensors staged so far in this update."""
        return len(self._staged)

    def receive(self, route: queue.Queue, step: int | None = None) -> list[tuple[str, Any]]:
        """Take buckets from ``route`` (a box of a :class:`BucketPost`) until the last one."""
        self._staged = []
        while True:
            try:
                message = route.get(timeout=self.timeout)
            except queue.Empty:
                self._staged = []
                raise UnavailableError(f"weight update: replica {self.name} got no bucket for "
                                       f"{self.timeout:g} s") from None
            if "failed" in message:
                self._staged = []
                raise UnavailableError(f"weight update: the sender failed mid-update: {message['failed']}")
            if step is not None and message.get("step") != step:
                self._staged = []
                raise DataLossError(f"weight update: a bucket of step {message.get('step')}, replica "
                                    f"{self.name} expected {step}")
            items = self.stage(message["bucket"], message["last"])
            if items is not None:
                return items

    def finalize(self) -> None:
        """Drop a half-staged update."""
        self._staged = []


class RefsCarrier:
    """Routes within one process: a :class:`BucketPost` and its boxes."""

    name = "refs"
    sender_prepares = False

    def sending_end(self, bucket_bytes: int, timeout: float) -> RefsSendingEnd:
        """A sending end."""
        return RefsSendingEnd(bucket_bytes, timeout)

    def receiving_end(self, name: str, timeout: float) -> RefsReceivingEnd:
        """A receiving end that checks types only."""
        return RefsReceivingEnd(name, timeout)

    def routes(self, sender: dict, receivers: list[dict]) -> tuple[Any, list[Any]]:
        """A post with one box per receiver (waiting as long as the most patient one)."""
        post = BucketPost(len(receivers), max(float(r.get("timeout", 120.0)) for r in receivers))
        return post, list(post.boxes)
