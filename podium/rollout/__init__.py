"""``podium.rollout``: rollout roles hosting an inference engine (vLLM) in the worker process.

A top layer: it uses ``podium.worker`` (and ``podium.controller`` for
:func:`~podium.rollout.sync.push_weights`); nothing below imports it. Modules:

* :mod:`podium.rollout.vllm`: :class:`VLLMRollout`, the role;
* :mod:`podium.rollout.config`: :class:`RolloutConfig`, its validated settings;
* :mod:`podium.rollout.outputs`: the fields ``generate_sequences`` returns;
* :mod:`podium.rollout.weights`: sibling lookup, name/shape checks, :class:`WeightSource`;
* :mod:`podium.rollout.sync`: cross-process weight sync in buckets;
* :mod:`podium.rollout.grpo`: the GRPO actor/reference roles of ``examples/grpo_vllm.py``;
* :mod:`podium.rollout.tinymodel`: random Llama models and a tokenizer, built offline;
* :mod:`podium.rollout.broadcast` / :mod:`podium.rollout.broadcastgroups`: the weight
  broadcast chain to rollout replicas;
* :mod:`podium.rollout.engine`: :class:`EngineLoop`, a vLLM engine stepped by one thread;
* :mod:`podium.rollout.server`: :class:`RolloutServer`, a disaggregated rollout replica (actor);
* :mod:`podium.rollout.servermanager`: :class:`RolloutServerManager`, load balancing and
  weight updates over the replicas;
* :mod:`podium.rollout.asyncgrpo`: the off-policy trainer of ``examples/grpo_async.py``.

vLLM is imported only when an engine is built, so this package imports without it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["VLLMRollout", "RolloutConfig", "WeightSource", "push_weights", "build_tiny_llama", "EngineLoop",
           "RolloutServer", "RolloutServerManager", "AsyncGRPOTrainer"]

_WHERE = {"VLLMRollout": "podium.rollout.vllm", "RolloutConfig": "podium.rollout.config",
          "WeightSource": "podium.rollout.weights", "push_weights": "podium.rollout.sync",
          "build_tiny_llama": "podium.rollout.tinymodel", "EngineLoop": "podium.rollout.engine",
          "RolloutServer": "podium.rollout.server", "RolloutServerManager": "podium.rollout.servermanager",
          "AsyncGRPOTrainer": "podium.rollout.asyncgrpo"}


def __getattr__(name: str) -> Any:
    """Import the public names on first use (torch and transformers load only then)."""
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'podium.rollout' has no attribute {name!r}")
