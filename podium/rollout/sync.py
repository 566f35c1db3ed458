"""Weight sync across processes: the actor's buckets reach the rollout over Podium's data path.

When the rollout is NOT colocated with the actor (another process or another node),
:func:`push_weights` moves the weights in buckets: actor rank 0 (a
:class:`podium.rollout.weights.WeightSource`, the refs carrier's sending end) plans buckets of at most ``bucket_bytes``
and holds each one (a ``blocking=False`` call); every rollout rank fetches it straight from
that worker (worker to worker, never through the controller) and stages it; the last
bucket's call loads them all. At most two buckets are held at a time: the next one is
prepared while the rollout fetches the current one. The whole model is never one message.
"""

from __future__ import annotations

import time
from typing import Any

from podium.errors import InvalidArgumentError
from podium.rollout.weights.plan import DEFAULT_BUCKET_BYTES

__all__ = ["push_weights"]



def push_weights(actor: Any, rollout: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout: float = 600.0) -> dict:
    """Copy actor rank 0's weights into every rank of ``rollout`` (both WorkerGroups or role
    views); returns ``{"buckets", "bytes", "seconds", "MBps"}``.

    ``actor``'s role must mix in :class:`~podium.rollout.weights.WeightSource`; ``rollout``
    is a :class:`~podium.rollout.vllm.VLLMRollout` group. ``timeout`` bounds each bucket.
    """
    if not isinstance(bucket_bytes, int) or not (1 << 10) <= bucket_bytes <= (1 << 34):
        raise InvalidArgumentError(f"bucket_bytes must be an int in [1 KiB, 16 GiB], got {bucket_bytes!r}")
    start = time.monotonic()
    plan = actor.rollout_weight_plan(bucket_bytes)
    count = plan[0] if isinstance(plan, list) else plan
    total = 0
    nxt = _first(actor.rollout_weight_bucket(0))
    for index in range(count):
        current = nxt
        ref = current.ref(timeout=timeout)
        # The next bucket is held while the rollout fetches this one.
        nxt = _first(actor.rollout_weight_bucket(index + 1)) if index + 1 < count else None
        rollout.update_weights(bucket=ref, finish=index + 1 == count)
        total += ref.size_bytes
        del current, ref  # the held bucket is released once nothing names it
    seconds = time.monotonic() - start
    return {"buckets": count, "bytes": total, "seconds": seconds, "MBps": total / 1e6 / max(seconds, 1e-9)}


def _first(result: Any) -> Any:
    # RANK_ZERO execution answers rank 0's PendingRef, alone or in a one-item list.
    return result[0] if isinstance(result, (list, tuple)) else result
