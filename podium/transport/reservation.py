"""Payload memory reserved as the data arrives, bounded per connection (issue #14).

A call's header announces its payload size; the receiver used to allocate (and zero-fill)
that many bytes at once, so one frame announcing 1 GiB followed by one byte took 1 GiB,
kept until a garbage collection after the client left. Here a :class:`GrowingAssembler`
holds only the bytes that arrived (its buffer grows with them), every byte it holds is
counted against its connection's :class:`ReservationBudget` (a peer cannot hold more
unfinished payload than that on one connection), and :meth:`GrowingAssembler.close`
(the connection ended, the call was cancelled or refused) gives it all back at once.
"""

from __future__ import annotations

from podium.errors import DataLossError, ResourceExhaustedError
from podium.memorypool import MIN_POOLED_BYTES, POOL
from podium.transport.chunks import check_announced

__all__ = ["ReservationBudget", "GrowingAssembler"]


class ReservationBudget:
    """Bytes of unfinished payloads one connection may hold (``limit``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: Bytes held right now by this connection's unfinished payloads.
        self.held = 0
        #: The most ever held at once (tests and stats).
        self.peak = 0

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` more, or ResourceExhaustedError (nothing counted) past the limit."""
        if self.held + nbytes > self.limit:
            raise ResourceExhaustedError(
                f"this connection's unfinished payloads would hold {self.held + nbytes} bytes, "
                f"more than its limit of {self.limit}; send fewer large calls at once",
                details={"held": str(self.held), "limit": str(self.limit)})
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` reserved earlier."""
        self.held = max(0, self.held - nbytes)


class GrowingAssembler:
    """Collects one payload's chunks into memory that is committed as they arrive.

    The interface of :class:`podium.transport.chunks.Assembler` (``total_size``,
    ``received``, ``done``, ``add``, ``result``), plus :meth:`close`. An announcement over
    ``max_size`` raises PayloadTooLargeError and more bytes than announced DataLossError,
    as there; bytes beyond the connection's ``budget`` raise ResourceExhaustedError.

    A large payload that fits the budget goes into a mapping of the process's pool
    (:mod:`podium.memorypool`): a reused one was touched before (no fresh pages), a new
    one is committed page by page as data lands in it. Others grow a bytearray.
    """

    def __init__(self, total_size: int, max_size: int, budget: ReservationBudget) -> None:
        check_announced(total_size, max_size)
        self.total_size = total_size
        self._budget = budget
        self._buffer = bytearray()
        self._mapping = None
        if MIN_POOLED_BYTES <= total_size <= budget.limit:
            try:
                self._mapping = POOL.take(total_size)
            except OSError:  # no address space for it now: grow a bytearray instead
                self._mapping = None
        self._received = 0
        self._reserved = 0

    @property
    def received(self) -> int:
        """Bytes received (and held) so far."""
        return self._received

    @property
    def done(self) -> bool:
        """Whether every announced byte has arrived."""
        return self._received == self.total_size

    def add(self, chunk: bytes | bytearray | memoryview) -> None:
        """Append ``chunk`` after the bytes already received."""
        view = memoryview(chunk)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        if not view.nbytes:
            return
        end = self._received + view.nbytes
        if end > self.total_size:
            raise DataLossError(f"payload overrun: {end} bytes arrived, {self.total_size} announced")
        self._budget.reserve(view.nbytes)
        self._reserved += view.nbytes
        if self._mapping is not None:
            self._mapping[self._received:end] = view
        else:
            self._buffer += view
        self._received = end

    def result(self) -> bytearray | memoryview:
        """The assembled payload, writable (it leaves the connection's budget); DataLossError
        if bytes are still missing."""
        if not self.done:
            raise DataLossError(f"payload truncated: {self._received} of {self.total_size} "
                                f"announced bytes arrived")
        mapping, buffer = self._mapping, self._buffer
        self._mapping = None
        self.close()
        return POOL.lease(mapping, self.total_size) if mapping is not None else buffer

    def close(self) -> None:
        """Drop what arrived and give its bytes back to the budget (idempotent)."""
        self._budget.release(self._reserved)
        self._reserved = 0
        self._buffer = bytearray()
        if self._mapping is not None:  # an unfinished payload: its pages go, not to the pool
            self._mapping.close()
            self._mapping = None
