"""``ray._raylet``: the names of Ray's core module that programs import from it: ``ObjectRef``,
``ObjectRefGenerator`` and its older name ``StreamingObjectRefGenerator``."""

from __future__ import annotations

from podium.compat.ray import ObjectRef, ObjectRefGenerator
from podium.compat.standin import missing

__all__ = ["ObjectRef", "ObjectRefGenerator", "StreamingObjectRefGenerator"]

#: Ray's former name of ObjectRefGenerator (kept by Ray for backward compatibility).
StreamingObjectRefGenerator = ObjectRefGenerator


def __getattr__(name: str):
    return missing(f"ray._raylet.{name}", "the public ray API (ray.ObjectRef, ray.ObjectRefGenerator)")
