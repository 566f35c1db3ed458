"""``ray._private.state``: ``state.placement_group_table(pg_id)`` and
``available_resources_per_node()``, the two calls verl's ``RayResourcePool`` makes."""

from __future__ import annotations

import types

from podium.compat.standin import (
    available_resources_per_node,
    missing,
    placement_group_table,
)

#: Ray's global state accessor; here only what verl reads.
state = types.SimpleNamespace(placement_group_table=placement_group_table,
                              available_resources_per_node=available_resources_per_node)

__all__ = ["available_resources_per_node", "state"]


def __getattr__(name: str):
    return missing(f"ray._private.state.{name}", "ray.nodes() / podium status")
