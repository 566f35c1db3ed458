"""``ray._private.runtime_env``: only ``constants`` is provided."""

from __future__ import annotations

from ray._private.runtime_env import constants

__all__ = ["constants"]
