"""The owner's watch over the processes that borrow its values: a borrower that died gives
back nothing itself, so the owner asks each borrower's address (``Describe``) while it holds
borrows, and gives back for it the borrows of one it takes for dead
(:meth:`~podium.worker.host.heldstore.HeldStore.borrower_gone`).

When a borrower is dead follows how the rest of Podium decides it, not a couple of missed
pings, so that a network partition does not free a live borrower's values:

* its address *refuses* the connection twice in a row: its host answered, and nothing
  listens there any more, so the process has ended (a killed or finished worker);
* or it has not been reached at all (unreachable, or every look past its deadline) for
  :data:`UNREACHABLE_SECONDS`, twice the scheduler's node lease: by then the scheduler has
  declared its node dead (a node that misses its lease is dead to the whole cluster, and its
  workers with it), so a partition shorter than that keeps the borrows, and a longer one is
  one the scheduler too has taken for a death.

A successful look (or one refused by the worker for another reason: alive) starts over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from podium import errors
from podium.auth import TlsConfig
from podium.worker.host.heldstore import HeldStore

__all__ = ["BorrowerWatch", "UNREACHABLE_SECONDS", "WATCH_SECONDS"]

log = logging.getLogger("podium.worker.host")

#: How often the owner looks at its borrowers while it has any.
WATCH_SECONDS = 1.0
#: Describe's deadline for one look.
_LOOK_TIMEOUT = 5.0
#: How long a borrower may stay unreached before it is taken for dead: twice the scheduler's
#: node lease (``podium.scheduler.records.DEFAULT_NODE_LEASE``, 15 s; a test checks the two
#: agree), after which the scheduler has declared its node dead.
UNREACHABLE_SECONDS = 30.0
#: The gRPC text of a connection refused by the borrower's host (nothing listens any more).
_REFUSED = "Connection refused"


class BorrowerWatch:
    """Watches the borrowers of one store's values (on the loop that serves it)."""

    def __init__(self, held: HeldStore, token: str, tls: TlsConfig | None, *, interval: float = WATCH_SECONDS,
                 look_timeout: float = _LOOK_TIMEOUT, unreachable_seconds: float = UNREACHABLE_SECONDS) -> None:
        self._held = held
        self._token = token
        self._tls = tls
        self._interval = interval
        self._look_timeout = look_timeout
        self._unreachable_seconds = unreachable_seconds
        self._task: asyncio.Task | None = None
        #: Per borrower not reached at its last look: (refusals in a row, when it was first missed).
        self._misses: dict[str, tuple[int, float]] = {}
        self._channels: dict[str, Any] = {}
        #: How many borrowers were taken for dead (tests and stats read it).
        self.found = 0

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
            await asyncio.sleep(self._interval)

    async def _look(self, borrower: str) -> None:
        channel = self._channels.get(borrower)
        if channel is None:
            from podium.worker.caller.channel import WorkerChannel

            channel = self._channels[borrower] = WorkerChannel(borrower, self._token, tls=self._tls)
        try:
            await channel.describe(timeout=self._look_timeout)
        except (errors.UnavailableError, errors.DeadlineExceededError) as exc:
            now = time.monotonic()
            refusals, since = self._misses.get(borrower, (0, now))
            refusals = refusals + 1 if _REFUSED in str(exc) else 0
            self._misses[borrower] = (refusals, since)
            if refusals >= 2 or now - since >= self._unreachable_seconds:
                dropped = self._held.borrower_gone(borrower)
                self.found += 1
                log.info("borrower %s is gone (%s): its borrows were given back (%d values dropped)", borrower,
                         "its address refuses connections" if refusals >= 2
                         else f"unreached for {now - since:.0f}s", dropped)
                self._forget(borrower)
            return
        except Exception:  # noqa: BLE001 - it answered, refusing: alive, looked at again later
            pass
        self._misses.pop(borrower, None)

    def _forget(self, borrower: str) -> None:
        self._misses.pop(borrower, None)
        channel = self._channels.pop(borrower, None)
        if channel is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().create_task(channel.close())
