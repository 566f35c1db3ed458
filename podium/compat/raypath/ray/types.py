"""``ray.types``: ``ObjectRef`` for annotations (vLLM's Ray executor imports it)."""

from __future__ import annotations

from podium.compat.ray import ObjectRef

__all__ = ["ObjectRef"]
