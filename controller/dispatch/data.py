"""The data side of dispatch: splitting a call's DataProto / TensorDict / DataProtoFuture
arguments over ranks and concatenating the ranks' outputs back (jagged nested tensors are
split and re-nested by row). :mod:`podium.controller.dispatch.modes` builds its dispatch and
collect functions on these.

A DataProto is Podium's (:mod:`podium.dataproto`) or verl's own ``verl.protocol.DataProto``
(native verl mode, :mod:`podium.compat.nativeverl`): verl's is chunked, padded and
concatenated by its own methods, so its rules are verl's.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from podium.dataproto import DataProto
from podium.errors import InvalidArgumentAssertion
from podium.refs import DataProtoFuture
from podium.rowcat import cat_tensordicts

__all__ = ["chunk", "concat", "concat_tensordict", "is_data", "is_future", "is_proto", "looks_like_ref",
           "padded_copy", "split_tensordict"]


def is_future(value: Any) -> bool:
    return isinstance(value, DataProtoFuture)


def is_proto(value: Any) -> bool:
    """A DataProto: Podium's, or verl's own once ``verl.protocol`` is imported."""
    if isinstance(value, DataProto):
        return True
    verl_protocol = sys.modules.get("verl.protocol")
    return verl_protocol is not None and isinstance(value, verl_protocol.DataProto)


def is_data(value: Any) -> bool:
    return is_proto(value) or isinstance(value, TensorDict) or is_future(value)


def padded_copy(value: Any, padding_size: int) -> Any:
    """A DataProto with ``padding_size`` more rows; the caller's object is left as it was
    (verl's ``padding`` pads in place: it gets a shallow copy, whose fields it reassigns)."""
    if isinstance(value, DataProto):
        return value.padded(padding_size)
    out = copy.copy(value)
    out.padding(padding_size)
    return out


def split_tensordict(td: TensorDict, chunks: int) -> list[TensorDict]:
    """Split a TensorDict into ``chunks`` equal parts along its batch dim.

    Jagged nested tensors (``layout=torch.jagged``) are split by row and re-nested, so
    each part keeps exactly its rows (verl's ``chunk_tensordict``). The length must divide.
    """
    n = td.batch_size[0]
    if n % chunks:
        raise InvalidArgumentAssertion(f"a TensorDict of {n} rows cannot be split into {chunks} equal chunks "
                                       f"({n} % {chunks} = {n % chunks} rows left over)")
    size = n // chunks
    nested = {key for key, value in td.items(include_nested=True, leaves_only=True)
              if isinstance(value, torch.Tensor) and value.is_nested}
    if not nested:
        return [td[i * size:(i + 1) * size].contiguous() for i in range(chunks)]
    plain = td.exclude(*nested)
    parts = [plain[i * size:(i + 1) * size].contiguous() for i in range(chunks)]
    for key in nested:
        rows = td.get(key).unbind()
        for i, part in enumerate(parts):
            part.set(key, torch.nested.as_nested_tensor(list(rows[i * size:(i + 1) * size]),
                                                         layout=torch.jagged))
    return parts


def concat_tensordict(parts: list[TensorDict]) -> TensorDict:
    """Concatenate TensorDicts along the batch dim; jagged nested tensors are re-nested."""
    nested = {key for key, value in parts[0].items(include_nested=True, leaves_only=True)
              if isinstance(value, torch.Tensor) and value.is_nested}
    if not nested:
        return cat_tensordicts(parts)
    out = cat_tensordicts([p.exclude(*nested) for p in parts])
    for key in nested:
        rows = [row for p in parts for row in p.get(key).unbind()]
        out.set(key, torch.nested.as_nested_tensor(rows, layout=torch.jagged))
    return out


def chunk(value: Any, chunks: int) -> list:
    if isinstance(value, TensorDict):
        return split_tensordict(value, chunks)
    return value.chunk(chunks)


def concat(outputs: list) -> Any:
    first = outputs[0]
    if is_future(first) or looks_like_ref(first):
        return _future_concat(outputs)
    if isinstance(first, TensorDict):
        return concat_tensordict(outputs)
    return type(first).concat(outputs)


def looks_like_ref(value: Any) -> bool:
    # Refs of blocking=False calls: podium.refs.ObjectRef, or the controller's pending refs.
    from podium.refs import ObjectRef
    if isinstance(value, ObjectRef):
        return True
    try:
        from podium.controller.session.futures import PendingRef
    except ImportError:  # pragma: no cover - the controller package is partially imported
        return False
    return isinstance(value, PendingRef)


#: Makes the future of a ``blocking=False`` call whose outputs are concatenated, when set:
#: native verl mode (:func:`podium.compat.nativeverl.install`, a layer above) sets one whose
#: futures are verl's ``DataProtoFuture`` too.
future_factory: Callable[[list], Any] | None = None


def _future_concat(outputs: list) -> Any:
    if future_factory is not None and "verl.protocol" in sys.modules:
        return future_factory(outputs)
    from podium.controller.session.futures import concat_refs
    return concat_refs(outputs)
