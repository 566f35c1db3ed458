"""``podium.rollout.weights``: one weight-update protocol from a trainer rank to rollout replicas.

* :mod:`~podium.rollout.weights.plan`: what is sent (:func:`state_dict_of`), in which
  buckets (:func:`plan_buckets`, :data:`DEFAULT_BUCKET_BYTES`), and the checks;
* :mod:`~podium.rollout.weights.carrier`: the carrier protocol (prepare, send, receive);
* the carriers: :mod:`~podium.rollout.weights.chain` (TCP / shared memory),
  :mod:`~podium.rollout.weights.collective` (NCCL / gloo), :mod:`~podium.rollout.weights.refs`
  (Podium object references);
* :mod:`~podium.rollout.weights.driver`: the one driver (:func:`drive_update`);
* :mod:`~podium.rollout.weights.endpoint`: the endpoints a role composes
  (:class:`WeightEndpoint` receives, :class:`WeightOutlet` sends);
* :mod:`~podium.rollout.weights.roles`: the registered methods that put them on a worker
  group (``BroadcastSource``, ``BroadcastTarget``, ``WeightSource``).
"""

from __future__ import annotations

from podium.rollout.weights.plan import (
    DEFAULT_BUCKET_BYTES,
    check_weights,
    plan_buckets,
    sibling_state_dict,
    state_dict_of,
)
from podium.rollout.weights.roles import WeightSource

__all__ = ["DEFAULT_BUCKET_BYTES", "check_weights", "plan_buckets", "sibling_state_dict", "state_dict_of",
           "WeightSource"]
