"""The owner's watch over the processes that borrow its values: a borrower that died gives
back nothing itself, so the owner asks each borrower's address (``Describe``) while it holds
borrows, and gives back for it the borrows of one that cannot be reached twice in a row
(:meth:`~podium.worker.host.heldstore.HeldStore.borrower_gone`). A borrower that only is
slow (a ``Describe`` past its deadline) is not taken for dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from podium import errors
from podium.auth import TlsConfig
from podium.worker.host.heldstore import HeldStore

__all__ = ["BorrowerWatch", "WATCH_SECONDS"]

log = logging.getLogger("podium.worker.host")

#: How often the owner looks at its borrowers while it has any.
WATCH_SECONDS = 1.0
#: Describe's deadline for one look.
_LOOK_TIMEOUT = 5.0


class BorrowerWatch:
    """Watches the borrowers of one store's values (on the loop that serves it)."""

    def __init__(self, held: HeldStore, token: str, tls: TlsConfig | None) -> None:
        self._held = held
        self._token = token
        self._tls = tls
        self._task: asyncio.Task | None = None
        self._misses: dict[str, int] = {}
        self._channels: dict[str, Any] = {}

    def ensure(self) -> None:
        """Watch from now on while borrows are held (on the loop; idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            borrowers = [b for b in self._held.borrowers() if b]  # ("": a borrower with no address)
            if not borrowers:
                self._misses.clear()
                return
            await asyncio.gather(*(self._look(b) for b in borrowers))
            await asyncio.sleep(WATCH_SECONDS)

    async def _look(self, borrower: str) -> None:
        channel = self._channels.get(borrower)
        if channel is None:
            from podium.worker.caller.channel import WorkerChannel

            channel = self._channels[borrower] = WorkerChannel(borrower, self._token, tls=self._tls)
        try:
            await channel.describe(timeout=_LOOK_TIMEOUT)
        except errors.UnavailableError:
            misses = self._misses[borrower] = self._misses.get(borrower, 0) + 1
            if misses >= 2:
                dropped = self._held.borrower_gone(borrower)
                log.info("borrower %s is gone: its borrows were given back (%d values dropped)", borrower, dropped)
                self._forget(borrower)
            return
        except Exception:  # noqa: BLE001 - slow or refusing: alive, looked at again later
            pass
        self._misses.pop(borrower, None)

    def _forget(self, borrower: str) -> None:
        self._misses.pop(borrower, None)
        channel = self._channels.pop(borrower, None)
        if channel is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().create_task(channel.close())
