"""``ray.util.placement_group``: Podium's placement groups (:mod:`podium.controller.remote.placement`)."""

from __future__ import annotations

from podium.controller.remote.placement import (
    PlacementGroup,
    get_current_placement_group,
    get_placement_group,
    placement_group,
    remove_placement_group,
)

from podium.compat.standin import missing, placement_group_table

__all__ = [
    "PlacementGroup",
    "get_current_placement_group",
    "get_placement_group",
    "placement_group",
    "placement_group_table",
    "remove_placement_group",
]


def __getattr__(name: str):
    return missing(f"ray.util.placement_group.{name}", "podium.controller.remote.placement")
