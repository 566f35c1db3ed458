"""The shared-memory segment files a test's processes left in ``/dev/shm``."""

from __future__ import annotations

import os

from podium.transport import shm

__all__ = ["mark_test_start", "segments_of"]

#: The segment files that existed when the running test started (``tests/conftest.py`` marks
#: each start): a test counts only what it made, not the segments an earlier test's senders
#: keep in this process for their next update, nor another job's.
_before: frozenset[str] = frozenset()


def mark_test_start() -> None:
    """Remember the segment files there are now; :func:`segments_of` leaves them out."""
    global _before
    try:
        _before = frozenset(os.listdir(shm.SHM_DIR))
    except FileNotFoundError:
        _before = frozenset()


def segments_of(*pids: int) -> list[str]:
    """Names in SHM_DIR created by any of ``pids`` (``podium-<pid>-...``) since the test began."""
    starts = tuple(f"{shm.PREFIX}{pid}-" for pid in pids)
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(starts) and n not in _before]
