"""Bounds on every count and duration a client can put in a request.

A request that asks for more than these is refused at once with an
:class:`~podium.errors.InvalidArgumentError` that names the field and the bound,
before it is applied to anything: no request can make a service hold a port, a
session or a process forever, or stall it placing a million bundles (issue #14).
The bounds are far above what a real job asks for (a verl job of 1,000 GPUs has
1,000 bundles and workers).
"""

from __future__ import annotations

import functools
import math

from google.protobuf.message import Message

from podium import errors

__all__ = ["MAX_BUNDLES", "MAX_REPEATED", "MAX_QUEUED_CALLS", "MAX_QUEUED_BYTES", "MAX_MAP_ENTRIES", "MAX_SESSION_LEASE_SECONDS",
           "MAX_PORT_HOLD_SECONDS", "MAX_GRACE_SECONDS", "MAX_TAIL_LINES", "check_count",
           "check_seconds", "check_repeated_fields"]

#: Bundles in one placement group (placing 10,000 takes about half a second).
MAX_BUNDLES = 10_000
#: Entries of any other list in a request (worker specs, ids, names, running workers, GPUs).
MAX_REPEATED = 10_000
#: Entries of a map in a request (a bundle's resources, a worker's env, node labels).
MAX_MAP_ENTRIES = 1_000
#: Longest controller session lease (a controller renews it every few seconds).
MAX_SESSION_LEASE_SECONDS = 3600.0
#: Longest time a node agent holds a reserved MASTER_PORT.
MAX_PORT_HOLD_SECONDS = 3600.0
#: Longest SIGTERM-to-SIGKILL grace a stop request may ask for.
MAX_GRACE_SECONDS = 600.0
#: Most log lines one TailLog may ask for.
MAX_TAIL_LINES = 1_000_000
#: ``blocking=False`` calls an actor's handle queues while its constructor runs, at most, and
#: the bytes of their arguments (each queued call keeps a copy of what it was given).
MAX_QUEUED_CALLS = 10_000
MAX_QUEUED_BYTES = 1 << 30

# Lists whose bound is not MAX_REPEATED, by (message full name, field name).
_LIST_BOUNDS = {
    ("podium.v1.CreatePlacementGroupRequest", "bundles"): MAX_BUNDLES,
}


def check_count(count: int, limit: int, what: str) -> int:
    """``count`` itself, or InvalidArgumentError when it exceeds ``limit``."""
    if count > limit:
        raise errors.InvalidArgumentError(f"{what}: {count} entries, more than the limit of {limit}")
    return count


def check_seconds(value: float, what: str, limit: float) -> float:
    """``value`` as seconds in [0, limit], or InvalidArgumentError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise errors.InvalidArgumentError(f"{what} must be a finite number of seconds, got {value!r}")
    if not 0 <= value <= limit:
        raise errors.InvalidArgumentError(f"{what} = {value!r} must be in [0, {limit:g}] seconds")
    return float(value)


def check_repeated_fields(message: Message, path: str = "") -> None:
    """Refuse a request with any list or map (at any depth) over its bound.

    Lengths are checked before elements are visited, so a list of a million
    entries is refused after one comparison, not a million.
    """
    if not _has_lists(message.DESCRIPTOR):
        return
    name = message.DESCRIPTOR.full_name
    path = path or f"{message.DESCRIPTOR.name}."
    for field, value in message.ListFields():
        label = f"{path}{field.name}"
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            check_count(len(value), MAX_MAP_ENTRIES, label)
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                for key, item in value.items():
                    check_repeated_fields(item, f"{label}[{key!r}].")
        elif field.is_repeated:
            check_count(len(value), _LIST_BOUNDS.get((name, field.name), MAX_REPEATED), label)
            # Items without lists of their own (a heartbeat's GPUs) need no visit each.
            if field.message_type is not None and _has_lists(field.message_type):
                for i, item in enumerate(value):
                    check_repeated_fields(item, f"{label}[{i}].")
        elif field.message_type is not None:
            check_repeated_fields(value, f"{label}.")


@functools.cache
def _has_lists(descriptor) -> bool:
    """True when a message type holds a list or map at any depth (so it must be visited)."""
    return _reaches_list(descriptor, set())


def _reaches_list(descriptor, seen: set) -> bool:
    if descriptor.full_name in seen:
        return False  # a recursive type: its lists, if any, are found on the first visit
    seen.add(descriptor.full_name)
    for field in descriptor.fields:
        if field.is_repeated:  # maps are repeated entry messages too
            return True
        if field.message_type is not None and _reaches_list(field.message_type, seen):
            return True
    return False
