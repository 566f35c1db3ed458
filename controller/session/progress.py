"""Progress lines for long controller operations (starting a large WorkerGroup).

A :class:`Progress` stays silent while the operation is quick. Once it has run for
``after`` seconds (2 by default) it prints the current phase, and from then on one line
per new phase, to stderr::

    podium: WorkerGroup 'ab12cd' (64 workers): 40/64 workers running (3.1s)

Runs on the runtime's event loop (the timer is a ``call_later``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

__all__ = ["Progress", "PROGRESS_AFTER"]

#: Seconds an operation runs before it starts reporting its phases.
PROGRESS_AFTER = 2.0


class Progress:
    """Phase reporting for one operation (see the module docstring)."""

    #: Least seconds between two lines of ``count`` updates.
    count_interval = 1.0

    def __init__(self, what: str, *, after: float = PROGRESS_AFTER, stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.what = what
        self.after = after
        self.enabled = enabled
        self._stream = stream
        self._start = time.monotonic()
        self._phase = ""
        self._printed = ""
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        if enabled:
            self._timer = asyncio.get_running_loop().call_later(after, self._print)

    @property
    def late(self) -> bool:
        """True once the operation has run longer than ``after``."""
        return time.monotonic() - self._start >= self.after

    def phase(self, text: str, *, count: bool = False) -> None:
        """Enter a phase; printed at once if the operation is already late. A ``count``
        update (``3/64 constructed``) prints at most once a second."""
        self._phase = text
        if self.late and not (count and time.monotonic() - self._last < self.count_interval):
            self._print()

    def done(self, text: str = "ready") -> None:
        """End: a last line if anything was printed, and no more lines."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._printed:
            self._phase = text
            self._print()
        self.enabled = False

    def _print(self) -> None:
        if not self.enabled or not self._phase or self._phase == self._printed:
            return
        self._printed = self._phase
        self._last = time.monotonic()
        out = self._stream or sys.stderr
        out.write(f"podium: {self.what}: {self._phase} ({time.monotonic() - self._start:.1f}s)\n")
        out.flush()
