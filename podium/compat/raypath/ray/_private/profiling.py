"""``ray._private.profiling``: ``profile(event_type, extra_data)``, a span in
``ray.timeline()`` (Podium's timeline, :mod:`podium.compat.rayinternals`)."""

from __future__ import annotations

from podium.compat.rayinternals import profile
from podium.compat.standin import missing

__all__ = ["profile"]


def __getattr__(name: str):
    return missing(f"ray._private.profiling.{name}", "ray.timeline() / podium.timeline")
