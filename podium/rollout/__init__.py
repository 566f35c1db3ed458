"""``podium.rollout``: rollout roles hosting an inference engine (vLLM), and weight updates to them.

A top layer: it uses ``podium.worker`` (and ``podium.controller`` for
:func:`~podium.rollout.sync.push_weights` and the server manager); nothing below imports it.

* The roles: :mod:`podium.rollout.vllm` (:class:`VLLMRollout`, an engine colocated with
  training), :mod:`podium.rollout.server` (:class:`RolloutServer`, a disaggregated replica,
  an actor) and :mod:`podium.rollout.servermanager` (:class:`RolloutServerManager`: load
  balancing, weight updates, replacing replicas that died or missed an update);
  :mod:`podium.rollout.engine` (:class:`EngineLoop`, a vLLM engine stepped by one thread),
  :mod:`podium.rollout.config` (:class:`RolloutConfig`) and :mod:`podium.rollout.outputs`
  (the fields ``generate_sequences`` returns).
* Weight updates: :mod:`podium.rollout.weights` (the plan, the carrier protocol, the
  carriers, the one driver, the endpoints a role composes), over the wires
  :mod:`podium.rollout.broadcast` (the chain; with :mod:`~podium.rollout.broadcastshm` and
  :mod:`~podium.rollout.broadcastdoor`) and :mod:`podium.rollout.broadcastcollective`;
  :mod:`podium.rollout.broadcastgroups` (:func:`broadcast_weights` over worker groups) and
  :mod:`podium.rollout.sync` (:func:`push_weights`, the refs carrier's driver).
* :mod:`podium.rollout.recipes`: the GRPO trainers of the examples and the tiny offline
  model; not part of this package's interface.

vLLM is imported only when an engine is built, so this package imports without it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["VLLMRollout", "RolloutConfig", "WeightSource", "push_weights", "EngineLoop",
           "RolloutServer", "RolloutServerManager", "broadcast_weights"]

_WHERE = {"VLLMRollout": "podium.rollout.vllm", "RolloutConfig": "podium.rollout.config",
          "WeightSource": "podium.rollout.weights", "push_weights": "podium.rollout.sync",
          "EngineLoop": "podium.rollout.engine", "RolloutServer": "podium.rollout.server",
          "RolloutServerManager": "podium.rollout.servermanager",
          "broadcast_weights": "podium.rollout.broadcastgroups"}


def __getattr__(name: str) -> Any:
    """Import the public names on first use (torch and transformers load only then)."""
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'podium.rollout' has no attribute {name!r}")
