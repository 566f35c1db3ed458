"""``ray.util.timer``: Ray's ``_Timer`` (ROLL times its pipeline steps with it)."""

from __future__ import annotations

from podium.compat.rayinternals import Timer as _Timer
from podium.compat.standin import missing

__all__ = ["_Timer"]


def __getattr__(name: str):
    return missing(f"ray.util.timer.{name}", "ray.util.timer._Timer, or time.perf_counter")
