"""``ray._private``: the internals verl reads (``state``, ``runtime_env.constants``)."""

from __future__ import annotations

from podium.compat.standin import missing
from ray._private import runtime_env, state

__all__ = ["runtime_env", "state"]


def __getattr__(name: str):
    return missing(f"ray._private.{name}", "the public podium.compat.ray API")
