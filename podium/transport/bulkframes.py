"""Bulk frames of the raw call socket (:mod:`podium.transport.callsocket`): a whole payload
after its message, read straight from the socket into its final buffer.

:class:`IncomingBulk` is such a payload while its bytes arrive (taken from the process's
reused mappings, :mod:`podium.memorypool`, or refused before any memory is taken when it is
larger than the receiver's limit, or when the process's unfinished payloads would pass
their bound, :data:`podium.transport.chunks.RECEIVING`); :class:`BulkFrame` is what the
receiver gets once it is complete. A payload cut off mid-way gives its pages back to the
kernel, and so, when its connection ends, does every mapping it filled
(:meth:`podium.memorypool.MemoryPool.release_pages_of`).
"""

from __future__ import annotations

from typing import Any

from podium import errors
from podium.memorypool import MIN_POOLED_BYTES, POOL
from podium.transport.chunks import RECEIVING

__all__ = ["BulkFrame", "IncomingBulk"]

# A refused payload's bytes are read into a scratch buffer of at most this size and dropped.
_SCRATCH = 1 << 20


class BulkFrame:
    """A bulk frame as it arrives: the ``message`` (its ``data`` empty) and the payload.

    ``data`` is a writable view of the payload in a reused mapping (it goes back to the
    pool when every value decoded from it is gone), or None with ``error`` set when the
    payload was refused (larger than this side's limit).
    """

    __slots__ = ("message", "data", "error")

    def __init__(self, message: Any, data: memoryview | None, error: errors.PodiumError | None = None) -> None:
        self.message = message
        self.data = data
        self.error = error


class IncomingBulk:
    """The payload of a bulk frame while its bytes arrive; ``owner`` is the connection's
    key for the pool's mappings (:meth:`~podium.memorypool.MemoryPool.fill_for`)."""

    __slots__ = ("message", "size", "received", "buffer", "view", "error", "_reserved")

    def __init__(self, message: Any, size: int, max_size: int, owner: object = None) -> None:
        self.message = message
        self.size = size
        self.received = 0
        self.error: errors.PodiumError | None = None
        self.buffer: Any = None  # a pooled mapping, for a payload of MIN_POOLED_BYTES or more
        self._reserved = 0
        if size > max_size:  # refused before any memory is taken for it
            self.error = errors.PayloadTooLargeError(
                f"payload of {size} bytes exceeds the maximum of {max_size} bytes",
                details={"size": str(size), "max_size": str(max_size)})
        else:
            try:
                RECEIVING.reserve(size)
                self._reserved = size
            except errors.ResourceExhaustedError as exc:
                self.error = exc
        if self.error is not None:
            self.view = memoryview(bytearray(min(size, _SCRATCH)))
        elif size < MIN_POOLED_BYTES:  # small: malloc reuses its heap, a mapping is 1 MiB at least
            self.view = memoryview(bytearray(size))
        else:
            self.buffer = POOL.take(size)
            self.view = memoryview(self.buffer)
            if owner is not None:
                POOL.fill_for(self.buffer, owner)

    def target(self) -> memoryview:
        """Where the next bytes go (never past the payload's end)."""
        left = self.size - self.received
        if self.error is not None:
            return self.view[:min(left, len(self.view))]
        return self.view[self.received:self.size]

    def add(self, nbytes: int) -> None:
        """``nbytes`` more arrived in :meth:`target`."""
        self.received += nbytes

    def fill(self, data: memoryview) -> None:
        """Copy bytes that arrived in the frame buffer (after the message) into place."""
        if self.error is None:
            self.view[self.received:self.received + len(data)] = data
        self.received += len(data)

    def finish(self) -> BulkFrame:
        """The complete frame (call once every byte arrived)."""
        self._release()
        if self.error is not None:
            return BulkFrame(self.message, None, self.error)
        if self.buffer is None:
            return BulkFrame(self.message, self.view)
        self.view.release()
        return BulkFrame(self.message, POOL.lease(self.buffer, self.size))

    def abandon(self) -> None:
        """The connection ended mid-payload: the mapping goes back without its pages."""
        self._release()
        if self.buffer is not None:
            self.view.release()
            POOL.drop_pages(self.buffer)
            POOL.give_back(self.buffer)
            self.buffer = None

    def _release(self) -> None:
        RECEIVING.release(self._reserved)
        self._reserved = 0
