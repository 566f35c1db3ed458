"""The refs inside a call's arguments, at any depth: found (to keep their values alive until
the call ends) and resolved (a ref still computing is waited for before the arguments are
encoded, so it travels as the ObjectRef it becomes). Only top-level arguments are replaced
by values, in the worker, as in Ray; nested refs arrive as refs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from podium.controller.session.futures import PendingDataProtoFuture, PendingRef, _resolve_one, is_pending
from podium.refs import ObjectRef

__all__ = ["MAX_DEPTH", "MAX_WALK", "refs_inside", "resolve_args"]


#: How many objects :func:`refs_inside` looks at in one call's arguments at most.
MAX_WALK = 10_000
#: How deep :func:`refs_inside` looks into nested containers.
MAX_DEPTH = 16
_CONTAINERS = (list, tuple, dict, set, frozenset)


def refs_inside(values: Iterable[Any]) -> list[Any]:
    """Every ref inside ``values`` at any depth: PendingRefs, PendingDataProtoFutures and
    ObjectRefs (those ``put`` here among them), in lists, tuples, dicts, sets and dataclasses,
    up to :data:`MAX_DEPTH` levels and :data:`MAX_WALK` objects (a bound on what a call's
    arguments cost to look through; a ref beyond it still travels, but its call waits for it
    while encoding and does not keep it alive). Each object is looked at once."""
    found: list[Any] = []
    seen: set[int] = set()
    stack = [(v, 0) for v in values]
    walked = 0
    while stack and walked < MAX_WALK:
        value, depth = stack.pop()
        walked += 1
        if isinstance(value, (ObjectRef, PendingRef, PendingDataProtoFuture)):
            found.append(value)
            continue
        if depth >= MAX_DEPTH or id(value) in seen:
            continue
        if isinstance(value, _CONTAINERS):
            seen.add(id(value))
            items = value.values() if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            seen.add(id(value))
            stack.extend((getattr(value, f.name, None), depth + 1) for f in dataclasses.fields(value))
    return found


async def resolve_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Replace top-level pending handles by real ObjectRefs / DataProtoFutures (on the loop),
    and wait for the pending refs nested deeper (they travel as the refs they become)."""
    if not args and not kwargs:
        return args, kwargs
    inside = [v for v in refs_inside((*args, *kwargs.values())) if is_pending(v)]
    if not inside:
        return args, kwargs
    for value in inside:
        await _resolve_one(value)
    args = tuple([await _resolve_one(a) for a in args])
    kwargs = {k: await _resolve_one(v) for k, v in kwargs.items()}
    return args, kwargs
