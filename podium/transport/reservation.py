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
    """Collects one payload's chunks into a bytearray that grows as they arrive.

    The interface of :class:`podium.transport.chunks.Assembler` (``total_size``,
    ``received``, ``done``, ``add``, ``result``), plus :meth:`close`. An announcement over
    ``max_size`` raises PayloadTooLargeError and more bytes than announced DataLossError,
    as there; bytes beyond the connection's ``budget`` raise ResourceExhaustedError.
    """

    def __init__(self, total_size: int, max_size: int, budget: ReservationBudget) -> None:
        check_announced(total_size, max_size)
        self.total_size = total_size
        self._budget = budget
        self._buffer = bytearray()
        self._reserved = 0

    @property
    def received(self) -> int:
        """Bytes received (and held) so far."""
        return len(self._buffer)

    @property
    def done(self) -> bool:
        """Whether every announced byte has arrived."""
        return len(self._buffer) == self.total_size

    def add(self, chunk: bytes | bytearray | memoryview) -> None:
        """Append ``chunk`` after the bytes already received."""
        view = memoryview(chunk)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        if not view.nbytes:
            return
        end = len(self._buffer) + view.nbytes
        if end > self.total_size:
            raise DataLossError(f"payload overrun: {end} bytes arrived, {self.total_size} announced")
        self._budget.reserve(view.nbytes)
        self._reserved += view.nbytes
        self._buffer += view

    def result(self) -> bytearray:
        """The assembled payload (it leaves the connection's budget); DataLossError if bytes
        are still missing."""
        if not self.done:
            raise DataLossError(f"payload truncated: {len(self._buffer)} of {self.total_size} "
                                f"announced bytes arrived")
        buffer = self._buffer
        self.close()
        return buffer

    def close(self) -> None:
        """Drop what arrived and give its bytes back to the budget (idempotent)."""
        self._budget.release(self._reserved)
        self._reserved = 0
        self._buffer = bytearray()
