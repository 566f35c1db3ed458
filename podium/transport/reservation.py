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

from podium.errors import ResourceExhaustedError
from podium.transport.chunks import Assembler

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


class GrowingAssembler(Assembler):
    """:class:`podium.transport.chunks.Assembler` counted against a connection's ``budget``
    (required here): what a worker uses for the payloads of its calls."""

    def __init__(self, total_size: int, max_size: int, budget: ReservationBudget) -> None:
        super().__init__(total_size, max_size, budget)
