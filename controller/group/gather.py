"""The outcomes of one blocking group call, gathered without a future or task per rank.

A blocking call to N ranks waits until every rank answered or one failed. With an asyncio
future per rank, each answer also cost a done-callback scheduled on the loop and run on
its next turn: N handles per group call, on the one thread that serves every rank. Here
each rank's outcome is a slot that ``WorkerClient.submit_into`` settles directly (it is
the call's *sink*), and the group keeps a count and one future.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["GroupGather", "RankOutcome"]


class _Tally:
    """What the slots of one gather report to: the count left and the futures waiting on it.
    The slots point here, not to the gather, so nothing cycles: when the call is over, its
    values (views of received buffers) go as soon as the gather does, not at a collection."""

    __slots__ = ("left", "failures", "first", "all")

    def __init__(self, n: int) -> None:
        self.left = n
        self.failures = 0  # (failed() looks at the ranks only when one failed)
        self.first = asyncio.get_running_loop().create_future()  # every rank answered, or one failed
        self.all: asyncio.Future | None = None  # every rank answered (made when waited for)
        if not n:
            self.first.set_result(None)

    def settled(self, failed: bool) -> None:
        self.left -= 1
        if failed:
            self.failures += 1
        if not self.first.done() and (not self.left or failed):
            self.first.set_result(None)
        if not self.left and self.all is not None and not self.all.done():
            self.all.set_result(None)


class RankOutcome:
    """One rank's outcome: the sink ``WorkerClient.submit_into`` settles (a value or an error)."""

    __slots__ = ("_tally", "settled", "value", "error")

    def __init__(self, tally: _Tally) -> None:
        self._tally = tally
        self.settled = False
        self.value: Any = None
        self.error: BaseException | None = None

    def done(self) -> bool:
        """Whether the outcome has arrived (the sink protocol of ``submit_into``)."""
        return self.settled

    def set_result(self, value: Any) -> None:
        if not self.settled:
            self.settled = True
            self.value = value
            self._tally.settled(False)

    def set_exception(self, exc: BaseException) -> None:
        """Settle with ``exc`` (the first outcome wins); ``RankOutcome.set_exception`` is the
        ``on_error(sink, exc)`` of ``submit_into``."""
        if not self.settled:
            self.settled = True
            self.error = exc
            self._tally.settled(True)


class GroupGather:
    """The outcomes of the ``n`` ranks of one blocking group call (``ranks[i]`` is the sink
    of the i-th call), on the loop that settles them."""

    def __init__(self, n: int) -> None:
        self._tally = _Tally(n)
        self.ranks = [RankOutcome(self._tally) for _ in range(n)]

    async def first_failure_or_all(self) -> None:
        """Return once every rank answered or one of them failed."""
        await self._tally.first

    async def all_settled(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for every rank to answer."""
        tally = self._tally
        if not tally.left:
            return
        if tally.all is None:
            tally.all = asyncio.get_running_loop().create_future()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(tally.all), timeout)

    def failed(self) -> list[int]:
        """Indexes of the ranks whose call failed, in order."""
        if not self._tally.failures:
            return []
        return [i for i, outcome in enumerate(self.ranks) if outcome.error is not None]

    def values(self) -> list[Any]:
        """Every rank's value, in order (when none failed)."""
        return [outcome.value for outcome in self.ranks]
