"""``ray._private.async_compat``: ``is_async_func`` and ``has_async_methods`` (ROLL picks an
async actor's ``max_concurrency`` with it)."""

from __future__ import annotations

from podium.compat.rayinternals import has_async_methods, is_async_func
from podium.compat.standin import missing

__all__ = ["has_async_methods", "is_async_func"]


def __getattr__(name: str):
    return missing(f"ray._private.async_compat.{name}", "inspect.iscoroutinefunction")
