"""The shared-memory segment files a test's processes left in ``/dev/shm``."""

from __future__ import annotations

import os

from podium.transport import shm

__all__ = ["segments_of"]


def segments_of(*pids: int) -> list[str]:
    """Names in SHM_DIR created by any of ``pids`` (``podium-<pid>-...``)."""
    starts = tuple(f"{shm.PREFIX}{pid}-" for pid in pids)
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(starts)]
