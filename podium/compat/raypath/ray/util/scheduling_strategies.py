"""``ray.util.scheduling_strategies``: the two strategies Podium places by."""

from __future__ import annotations

from podium.controller.remote.actoroptions import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from podium.compat.standin import missing

__all__ = ["NodeAffinitySchedulingStrategy", "PlacementGroupSchedulingStrategy"]


def __getattr__(name: str):
    return missing(f"ray.util.scheduling_strategies.{name}",
                   "PlacementGroupSchedulingStrategy or NodeAffinitySchedulingStrategy")
