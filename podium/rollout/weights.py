"""Weights for a rollout engine: where they come from and whether they fit.

* :func:`sibling_state_dict` finds the actor role colocated in the same process (a
  ``create_colocated_worker_cls`` bundle) and takes its state dict by reference: no copy
  through the controller or disk.
* :func:`check_weights` compares names and shapes with the engine's model table and
  raises :class:`InvalidArgumentError` naming the first offenders.
* :func:`plan_buckets` splits a state dict into buckets of at most ``bucket_bytes`` (a
  tensor bigger than one bucket travels alone), for the cross-process path.
* :class:`WeightSource` is a mixin for an actor role: two registered methods that serve
  those buckets to a rollout in another process (see :mod:`podium.rollout.sync`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from podium.errors import InvalidArgumentError
from podium.worker.decorator import Dispatch, Execute, register

__all__ = ["sibling_state_dict", "state_dict_of", "check_weights", "plan_buckets", "WeightSource"]

#: At most this many offending names in an error message.
_SHOWN = 5


def state_dict_of(role: Any) -> Mapping[str, Any]:
    """The weights a role offers a rollout: ``role.rollout_state_dict()`` when it has one,
    else ``role.model.state_dict()`` (names as the model defines them)."""
    getter = getattr(role, "rollout_state_dict", None)
    if callable(getter):
        return getter()
    model = getattr(role, "model", None)
    if model is not None and callable(getattr(model, "state_dict", None)):
        return model.state_dict()
    raise InvalidArgumentError(f"{type(role).__name__} offers no weights: give it a rollout_state_dict() "
                               f"method or a torch module in .model")


def sibling_state_dict(worker: Any, role: str) -> Mapping[str, Any]:
    """The state dict of the role called ``role`` colocated with ``worker`` in this process."""
    siblings = getattr(worker, "fused_worker_dict", None) or {}
    if role not in siblings:
        raise InvalidArgumentError(
            f"no role {role!r} colocated in this process (colocated roles: {sorted(siblings) or 'none'}); "
            f"build the group with create_colocated_worker_cls, or sync across processes with "
            f"podium.rollout.sync.push_weights")
    return state_dict_of(siblings[role])


def check_weights(weights: Iterable[tuple[str, Any]], expected: Mapping[str, tuple[int, ...]],
                  complete: bool = True) -> list[tuple[str, Any]]:
    """``weights`` as a list of ``(name, detached tensor)``, after checking each name is in
    ``expected`` and has its shape, and (``complete``) that none of ``expected`` is missing:
    vLLM reloads layer by layer, so a partial update would leave layers half loaded.
    InvalidArgumentError names what does not match."""
    import torch

    items, unknown, wrong = [], [], []
    for name, tensor in weights:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"weights must be (str, torch.Tensor) pairs, got "
                                       f"({type(name).__name__}, {type(tensor).__name__})")
        shape = expected.get(name)
        if shape is None:
            unknown.append(name)
        elif tuple(tensor.shape) != tuple(shape):
            wrong.append(f"{name}: got {tuple(tensor.shape)}, model has {tuple(shape)}")
        items.append((name, tensor.detach()))
    missing = sorted(set(expected) - {name for name, _ in items}) if complete and items else []
    if unknown or wrong or missing:
        parts = []
        if unknown:
            parts.append(f"{len(unknown)} name(s) the model does not have: {unknown[:_SHOWN]}"
                         f" (model names look like {sorted(expected)[:3]})")
        if wrong:
            parts.append(f"{len(wrong)} shape mismatch(es): {wrong[:_SHOWN]}")
        if missing:
            parts.append(f"{len(missing)} name(s) missing (a full state dict is needed): {missing[:_SHOWN]}")
        raise InvalidArgumentError("weights do not match the engine's model: " + "; ".join(parts))
    if not items:
        raise InvalidArgumentError("no weights given")
    return items


def plan_buckets(state_dict: Mapping[str, Any], bucket_bytes: int) -> list[list[str]]:
    """Names of ``state_dict`` grouped into buckets of at most ``bucket_bytes`` each, in order."""
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise InvalidArgumentError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    buckets: list[list[str]] = []
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


class WeightSource:
    """Mixin for an actor role whose weights a rollout in ANOTHER process takes.

    ``rollout_weight_plan(bucket_bytes)`` fixes a plan and returns the number of buckets;
    ``rollout_weight_bucket(i)`` returns bucket ``i`` as ``{name: tensor}``. The second is
    registered ``blocking=False``, so each bucket stays in this worker
    and the rollout fetches it from here directly (:func:`podium.rollout.sync.push_weights`).
    """

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def rollout_weight_plan(self, bucket_bytes: int) -> int:
        """Plan buckets of at most ``bucket_bytes`` over the current weights; their count."""
        state = state_dict_of(self)
        self._rollout_plan = plan_buckets(state, bucket_bytes)
        return len(self._rollout_plan)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO, blocking=False)
    def rollout_weight_bucket(self, index: int) -> dict:
        """Bucket ``index`` of the last plan: ``{name: detached tensor}``."""
        plan = getattr(self, "_rollout_plan", None)
        if plan is None:
            raise InvalidArgumentError("rollout_weight_bucket before rollout_weight_plan")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(plan):
            raise InvalidArgumentError(f"bucket index {index!r} is not in [0, {len(plan)})")
        state = state_dict_of(self)
        return {name: state[name].detach() for name in plan[index]}
