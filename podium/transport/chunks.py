"""Payload chunks on gRPC streams, and the memory a receiver reserves for them.

A payload (the segments of :meth:`podium.codec.Encoded.to_segments`) is sent as
a sequence of chunks no larger than :data:`CHUNK_SIZE`, so no gRPC message
limit ever reaches the user. The sender announces the total size first; the
receiver refuses one over its limit before taking any memory, copies each chunk
into one buffer with :class:`Assembler` (the one copy of this hop), then hands the
buffer to :func:`podium.codec.decode`, which makes zero-copy views into it.

A receiver does not take the announced size at once: one frame announcing 1 GiB followed
by one byte would hold 1 GiB (issue #14). An assembler holds only the bytes that arrived,
every byte it holds is counted against its connection's :class:`ReservationBudget` (a peer
cannot hold more unfinished payload than that on one connection), and
:meth:`Assembler.close` (the connection ended, the call was cancelled or refused) gives it
all back at once. Every unfinished payload of the process, on any connection and either
transport (these chunks, the call socket's bulk frames), also counts against one process-wide
budget, :data:`RECEIVING` (``PODIUM_MAX_RECEIVING_BYTES``, else half of physical memory): many
connections together cannot hold more than that either.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterable, Iterator

from podium.errors import DataLossError, PayloadTooLargeError, ResourceExhaustedError
from podium.memorypool import MIN_POOLED_BYTES, POOL

__all__ = ["CHUNK_SIZE", "iter_chunks", "check_announced", "ReservationBudget", "ProcessBudget", "RECEIVING",
           "receiving_limit", "Assembler", "GrowingAssembler"]

#: Largest chunk :func:`iter_chunks` yields: 4 MiB less 64 KiB of headroom for
#: the message's other fields and framing, so a chunk message stays within a
#: default 4 MiB gRPC limit.
CHUNK_SIZE = 4 * 1024 * 1024 - 64 * 1024


def iter_chunks(segments: Iterable[memoryview | bytes | bytearray],
                chunk_size: int = CHUNK_SIZE) -> Iterator[bytes | memoryview]:
    """Yield the concatenation of ``segments`` in chunks of ``chunk_size`` bytes.

    Every chunk but the last is exactly ``chunk_size`` long. Spans that lie
    inside one segment are yielded as zero-copy memoryview slices of it; only
    the bytes that straddle segment boundaries (small headers, padding, the
    ends of buffers) are copied into a coalescing chunk, so at most one chunk's
    worth is copied per segment boundary and the whole payload is never joined.
    Empty payloads yield nothing. Protobuf ``bytes`` fields take only ``bytes``:
    ``bytes(chunk)`` is free for the coalesced chunks (already ``bytes``) and is
    the one copy of a slice.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    pending = bytearray()
    for segment in segments:
        view = memoryview(segment)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        pos, size = 0, view.nbytes
        if pending:
            take = min(chunk_size - len(pending), size)
            pending += view[:take]
            pos = take
            if len(pending) == chunk_size:
                yield bytes(pending)
                pending = bytearray()
        while size - pos >= chunk_size:
            yield view[pos:pos + chunk_size]
            pos += chunk_size
        if pos < size:
            pending += view[pos:]
    if pending:
        yield bytes(pending)


def check_announced(total_size: int, max_size: int) -> None:
    """Refuse a payload announcement before anything is reserved for it: a negative size is
    DataLossError, one over ``max_size`` PayloadTooLargeError naming both."""
    if total_size < 0:
        raise DataLossError(f"announced payload size is negative ({total_size})")
    if total_size > max_size:
        raise PayloadTooLargeError(
            f"payload of {total_size} bytes exceeds the maximum of {max_size} bytes",
            details={"size": str(total_size), "max_size": str(max_size)})


class ReservationBudget:
    """Bytes of unfinished payloads one connection may hold (``limit``)."""

    #: Whose payloads the budget counts, for its error.
    holder = "this connection's"

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
                f"{self.holder} unfinished payloads would hold {self.held + nbytes} bytes, "
                f"more than its limit of {self.limit}; send fewer large calls at once",
                details={"held": str(self.held), "limit": str(self.limit)})
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` reserved earlier."""
        self.held = max(0, self.held - nbytes)


def receiving_limit() -> int:
    """Bytes of unfinished payloads the whole process may hold: ``PODIUM_MAX_RECEIVING_BYTES``,
    else half of physical memory."""
    value = os.environ.get("PODIUM_MAX_RECEIVING_BYTES")
    if value:
        return max(0, int(value))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):
        return 4 << 30


class ProcessBudget(ReservationBudget):
    """The budget of every unfinished payload of the process (:data:`RECEIVING`): shared by
    all connections, so any thread may reserve and release; its limit is read when first used
    (:func:`receiving_limit`)."""

    holder = "this process's"

    def __init__(self) -> None:
        super().__init__(-1)
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` more, or ResourceExhaustedError (nothing counted) past the limit."""
        with self._lock:
            if self.limit < 0:
                self.limit = receiving_limit()
            super().reserve(nbytes)

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` reserved earlier."""
        with self._lock:
            super().release(nbytes)


#: Every unfinished payload of this process counts here too.
RECEIVING = ProcessBudget()


class Assembler:
    """Collects the chunks of one payload into memory that is committed as they arrive.

    ``total_size`` is the size the sender announced; ``max_size`` is this receiver's limit
    (a larger announcement raises PayloadTooLargeError before anything is allocated). More
    bytes than announced raise DataLossError at once; fewer are caught by :meth:`result`.
    With a ``budget`` (:class:`ReservationBudget`) every byte held is counted against it,
    and bytes beyond it raise ResourceExhaustedError.

    A large payload (that fits the budget) goes into a mapping of the process's pool
    (:mod:`podium.memorypool`): a reused one was touched before (no fresh pages), a new
    one is committed page by page as data lands in it. Others grow a bytearray.
    """

    def __init__(self, total_size: int, max_size: int, budget: ReservationBudget | None = None) -> None:
        check_announced(total_size, max_size)
        self.total_size = total_size
        self._budget = budget
        self._buffer = bytearray()
        self._mapping: mmap.mmap | None = None
        self._received = 0
        self._reserved = 0
        if total_size >= MIN_POOLED_BYTES and (budget is None or total_size <= budget.limit):
            try:
                self._mapping = POOL.take(total_size)
            except OSError:  # no address space for it now: grow a bytearray instead
                self._mapping = None

    @property
    def received(self) -> int:
        """Bytes received (and held) so far."""
        return self._received

    @property
    def done(self) -> bool:
        """Whether every announced byte has arrived."""
        return self._received == self.total_size

    def add(self, chunk: bytes | bytearray | memoryview) -> None:
        """Put ``chunk`` after the bytes already received."""
        view = memoryview(chunk)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        if not view.nbytes:
            return
        end = self._received + view.nbytes
        if end > self.total_size:
            raise DataLossError(f"payload overrun: {end} bytes arrived, {self.total_size} announced")
        if self._budget is not None:
            self._budget.reserve(view.nbytes)
            try:
                RECEIVING.reserve(view.nbytes)
            except ResourceExhaustedError:
                self._budget.release(view.nbytes)
                raise
            self._reserved += view.nbytes
        if self._mapping is not None:
            self._mapping[self._received:end] = view
        else:
            self._buffer += view
        self._received = end

    def result(self) -> bytearray | memoryview:
        """The assembled payload, writable (a bytearray, or a view of a pooled mapping that
        goes back to the pool with the last value decoded from it); it leaves the budget.
        Raises DataLossError if bytes are still missing."""
        if not self.done:
            raise DataLossError(f"payload truncated: {self._received} of {self.total_size} "
                                f"announced bytes arrived")
        mapping, buffer = self._mapping, self._buffer
        self._mapping = None
        self.close()
        return POOL.lease(mapping, self.total_size) if mapping is not None else buffer

    def close(self) -> None:
        """Drop what arrived and give its bytes back to the budget (idempotent)."""
        if self._budget is not None:
            self._budget.release(self._reserved)
            RECEIVING.release(self._reserved)
        self._reserved = 0
        self._buffer = bytearray()
        if self._mapping is not None:  # an unfinished payload: its pages go, not to the pool
            self._mapping.close()
            self._mapping = None


class GrowingAssembler(Assembler):
    """An :class:`Assembler` counted against a connection's ``budget`` (required here): what a
    worker uses for the payloads of its calls."""

    def __init__(self, total_size: int, max_size: int, budget: ReservationBudget) -> None:
        super().__init__(total_size, max_size, budget)
