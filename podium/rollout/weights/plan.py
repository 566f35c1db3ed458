"""The plan of a weight update: what is sent, in which buckets, and the checks every carrier applies.

* :func:`state_dict_of` is the weights a role offers; :func:`sibling_state_dict` finds the actor role colocated in the same process (a
  ``create_colocated_worker_cls`` bundle) and takes its state dict by reference: no copy
  through the controller or disk.
* :func:`check_weights` compares names and shapes with the engine's model table and
  raises :class:`InvalidArgumentError` naming the first offenders.
* :func:`plan_buckets` splits a state dict into buckets of at most ``bucket_bytes`` (a
  tensor bigger than one bucket travels alone), for the cross-process path.
* :data:`DEFAULT_BUCKET_BYTES` is the one bucket size every carrier defaults to;
  :func:`check_bucket_bytes` and :func:`check_timeout` bound what a caller sets.
* A bucket's layout (each tensor at a multiple of :data:`ALIGN`, described by a manifest of
  ``[name, dtype, shape, offset, nbytes]``) is shared by the chain and the collective:
  :func:`aligned`, :func:`carried_dtypes`, and :func:`tensor_views`, which checks a peer's
  manifest against its bucket before it makes any view.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from podium.errors import DataLossError, InvalidArgumentError

__all__ = ["DEFAULT_BUCKET_BYTES", "MAX_BUCKET_BYTES", "MAX_MANIFEST_BYTES", "MAX_TENSORS", "ALIGN",
           "sibling_state_dict", "state_dict_of", "check_weights", "plan_buckets", "check_bucket_bytes",
           "check_timeout", "aligned", "carried_dtypes", "tensor_views"]

#: The default bucket of every carrier: big enough that a manifest (or a call) per bucket
#: costs nothing, small next to a model.
DEFAULT_BUCKET_BYTES = 64 << 20
#: Bounds on what a peer may announce, and on what a caller may ask for.
MAX_MANIFEST_BYTES = 16 << 20
MAX_BUCKET_BYTES = 16 << 30
MAX_TENSORS = 1 << 20
#: Each tensor starts at a multiple of this in its bucket (any dtype's view is aligned).
ALIGN = 64
#: At most this many offending names in an error message.
_SHOWN = 5


def check_bucket_bytes(bucket_bytes: Any) -> int:
    """``bucket_bytes`` if it is an int in [1 KiB, 16 GiB]; InvalidArgumentError otherwise."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or \
            not 1 << 10 <= bucket_bytes <= MAX_BUCKET_BYTES:
        raise InvalidArgumentError(f"bucket_bytes must be an int in [1 KiB, 16 GiB], got {bucket_bytes!r}")
    return bucket_bytes


def check_timeout(timeout: Any) -> float:
    """``timeout`` as float seconds if it is in (0, 86400]; InvalidArgumentError otherwise."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
        raise InvalidArgumentError(f"timeout must be seconds in (0, 86400], got {timeout!r}")
    return float(timeout)


def aligned(offset: int) -> int:
    """``offset`` rounded up to the next multiple of :data:`ALIGN`."""
    return -(-offset // ALIGN) * ALIGN


def carried_dtypes() -> dict[str, Any]:
    """The dtypes a carrier moves, by their name without ``torch.``."""
    import torch

    kinds = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
             torch.int16, torch.int8, torch.uint8, torch.bool)
    extra = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
    return {str(d).removeprefix("torch."): d for d in (*kinds, *extra)}


def tensor_views(buffer: Any, entries: Any, dtypes: dict, items: list, who: str) -> int:
    """Append to ``items`` a ``(name, tensor)`` view of ``buffer`` (a uint8 tensor) for each
    ``[name, dtype, shape, offset, nbytes]`` of a bucket manifest; the bytes they cover.
    DataLossError for an entry that does not fit the bucket (a peer's manifest is checked,
    never trusted)."""
    import math

    if not isinstance(entries, list) or len(items) + len(entries) > MAX_TENSORS:
        raise DataLossError(f"weight broadcast: {who} sent a bucket manifest without a tensor list")
    total = 0
    for entry in entries:
        try:
            name, dtype, shape, offset, nbytes = entry
            kind = dtypes[dtype]
            count = math.prod(int(s) for s in shape)
            ok = (isinstance(name, str) and offset % ALIGN == 0 and 0 <= offset
                  and offset + nbytes <= buffer.numel() and count * kind.itemsize == nbytes)
        except (TypeError, ValueError, KeyError):
            ok = False
        if not ok:
            raise DataLossError(f"weight broadcast: {who} sent a tensor entry that does not fit its "
                                f"bucket: {str(entry)[:200]}")
        items.append((name, buffer[offset:offset + nbytes].view(kind).view(tuple(shape))))
        total += nbytes
    return total


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
