"""``ray.scripts.scripts``: ``memory_summary`` (:mod:`podium.compat.raymemory`), which NeMo-RL's
driver memory tracker imports; the rest of Ray's command line is the ``ray`` command under
``podium run`` (:mod:`podium.compat.raycli`)."""

from __future__ import annotations

from podium.compat.raymemory import memory_summary
from podium.compat.standin import missing

__all__ = ["memory_summary"]


def __getattr__(name: str):
    return missing(f"ray.scripts.scripts.{name}", "the `ray` command under `podium run` (start, status, stop)")
