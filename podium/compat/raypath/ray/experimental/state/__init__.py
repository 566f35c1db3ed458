"""``ray.experimental.state``: see :mod:`ray.experimental.state.api`."""

from __future__ import annotations

from ray.experimental.state import api

__all__ = ["api"]
