"""Reusable shared-memory segments between two processes on one call connection.

A one-shot segment (:mod:`podium.transport.shm`) costs far more than its copy: the kernel hands
out and zeroes fresh tmpfs pages on write, and takes them back on unmap. Measured on the
2-core machines Podium targets, 128 MiB costs ~70 ms to write into a new segment and
~35 ms to unmap, against ~7 ms for the copy itself. A training loop sends batches of
the same size step after step, so each side of a call connection keeps the segments
it wrote and writes the next payload into one the peer has finished with:

* The **writer** (:class:`SegmentPool`) creates a segment once (``posix_fallocate``,
  so a full ``/dev/shm`` is an ``OSError`` now rather than a ``SIGBUS`` later), keeps
  it mapped, and copies each payload into a free one. It sends the name with the
  header's ``shm_pooled`` flag.
* The **reader** (:class:`SegmentCache`) maps a name the first time it sees it and
  unlinks the file at once (so nothing can leak once both sides have mapped it: the
  memory goes when both mappings go, crash or not), keeps the mapping, and decodes
  the payload as zero-copy views through a *lease*. When the last view of a lease
  dies, the reader tells the writer (``shm_released`` in a frame); only then may the
  writer reuse the segment.
* A writer that drops a segment (over its budget, a failed call, a closed connection)
  tells the reader (``shm_forget``); the reader lets its mapping go once no view uses it.
* A reply may come back *in* the writer's segment: a method that changed its argument in
  place and returned it is answered with references into the argument's segment
  (``SyncInvoker.package``), decoded here as views of it (:meth:`SegmentPool.view`). So
  the writer pins a call's argument segment until its reply is decoded (the reader's
  release of it may arrive first), and a segment goes back to the free list only once
  it is released, unpinned and no view of it is left.

Both classes are thread-safe: a worker's result is written on its execution thread and
the last view of a lease may die on any thread. Messages to the peer go through the
``send`` callback given to each, which must itself be safe to call from any thread.
The segments' memory and its budget are :mod:`podium.transport.shmsegment`'s; one pool and
one cache per connection, with the frames between them, are
:class:`podium.transport.sharedsegments.SharedSegments`.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from podium.errors import DataLossError, PayloadTooLargeError
from podium.memorypool import copy_segments
from podium.transport import shm
from podium.transport.shmsegment import address_of, budget, close_mapping, create_segment, lent_view, rounded

__all__ = ["SegmentPool", "SegmentCache", "REF_MIN_BYTES", "ref_triples"]

#: Buffers at least this large travel as references into a shared segment (a group call's
#: staged arguments, a result written in place); smaller ones are cheaper to copy.
REF_MIN_BYTES = 1 << 16
# Free segments a pool keeps for reuse; more are forgotten (least recently released first).
_MAX_FREE = 2
# Whole segments a pool may have at once (free + in the peer's hands).
_MAX_SEGMENTS = 8


class _Segment:
    __slots__ = ("name", "size", "mapping", "fresh", "peer", "pins", "views")

    def __init__(self, name: str, size: int, mapping: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self.mapping = mapping
        #: Never released by the peer yet: its file may still exist (the peer unlinks it
        #: when it maps it), so dropping the segment must remove the file too.
        self.fresh = True
        #: In the peer's hands (written for it, not yet released).
        self.peer = False
        #: Calls in flight that may still be answered with views of it (``write(pin=True)``).
        self.pins = 0
        #: Values of this side that view it (a reply written in place, see :meth:`SegmentPool.view`).
        self.views = 0

    @property
    def in_use(self) -> bool:
        return self.peer or self.pins > 0 or self.views > 0

    def drop(self) -> None:
        if self.fresh:
            shm.remove_segment(self.name)
        close_mapping(self.mapping)


class SegmentPool:
    """The writer's segments for one peer (see the module docstring).

    ``send_forget(names)`` tells the peer to let go of segments this pool dropped.
    """

    def __init__(self, send_forget: Callable[[list[str]], None]) -> None:
        self._send_forget = send_forget
        self._lock = threading.Lock()
        self._free: list[_Segment] = []
        self._busy: dict[str, _Segment] = {}
        self._closed = False

    @property
    def segments(self) -> int:
        """Segments held now (free and in the peer's hands)."""
        with self._lock:
            return len(self._free) + len(self._busy)

    @property
    def busy(self) -> int:
        """Segments in use now: in the peer's hands, pinned, or viewed by a value here."""
        with self._lock:
            return len(self._busy)

    def write(self, segments: Sequence[Any], nbytes: int, pin: bool = False) -> str | None:
        """Copy a payload of ``nbytes`` (the concatenation of ``segments``) into a pooled
        segment and return its name; the segment belongs to the peer until it is released.

        With ``pin`` it also stays out of reuse until :meth:`unpin`, even once the peer has
        released it: a call whose reply may come back as views of its argument's segment
        (see :meth:`view`) pins it until that reply is decoded.

        None when the pool cannot take it (its budget or segment count is spent): the
        caller then uses a one-shot segment or TCP. Raises OSError when ``/dev/shm``
        cannot hold a new segment.
        """
        segment = self._take(nbytes)
        if segment is None:
            return None
        if pin:
            with self._lock:
                segment.pins += 1
        try:
            written = copy_segments(segment.mapping, segments)
            if written != nbytes:
                raise ValueError(f"payload segments hold {written} bytes, expected {nbytes}")
        except BaseException:
            self._discard(segment)
            raise
        return segment.name

    def _take(self, nbytes: int) -> _Segment | None:
        with self._lock:
            if self._closed:
                return None
            fits = [s for s in self._free if s.size >= nbytes]
            if fits:
                segment = min(fits, key=lambda s: s.size)
                self._free.remove(segment)
                segment.peer = True
                self._busy[segment.name] = segment
                return segment
            if len(self._free) + len(self._busy) >= _MAX_SEGMENTS:
                self._evict_free_locked(keep=0)
                if len(self._busy) >= _MAX_SEGMENTS:
                    return None
        size = rounded(nbytes)
        if not budget.take(size):
            self._evict_all_free()  # make room for the next call
            if not budget.take(size):
                return None
        try:
            name, mapping = create_segment(size)
        except BaseException:
            budget.give(size)
            raise
        segment = _Segment(name, size, mapping)
        with self._lock:
            if self._closed:
                segment.drop()
                budget.give(size)
                return None
            segment.peer = True
            self._busy[segment.name] = segment
        return segment

    def _evict_free_locked(self, keep: int) -> None:
        dropped = []
        while len(self._free) > keep:
            # The least recently released first: the free list is in release order, and a
            # loop's batches are the sizes it used last (not necessarily the largest).
            segment = self._free.pop(0)
            segment.drop()
            budget.give(segment.size)
            dropped.append(segment.name)
        if dropped:
            self._send_forget(dropped)

    def _evict_all_free(self) -> None:
        with self._lock:
            self._evict_free_locked(keep=0)

    def release(self, names: Sequence[str]) -> list[str]:
        """The peer is done with these segments: they may be written again (once no pin
        or view of this side holds them). Returns the names this pool does not hold (dropped
        meanwhile by a failed call, or not the pool's: staged ones)."""
        unknown = []
        with self._lock:
            for name in names:
                segment = self._busy.get(name)
                if segment is None:
                    unknown.append(name)
                    continue
                segment.fresh = False
                segment.peer = False
                self._settle_locked(segment)
        return unknown

    def holds(self, name: str) -> bool:
        """Whether ``name`` is one of this pool's segments in use."""
        with self._lock:
            return name in self._busy

    def unpin(self, name: str) -> None:
        """The call that pinned ``name`` is over (its reply decoded, or it failed)."""
        with self._lock:
            segment = self._busy.get(name)
            if segment is not None and segment.pins > 0:
                segment.pins -= 1
                self._settle_locked(segment)

    def view(self, name: str, offset: int, length: int) -> memoryview:
        """A writable view of ``length`` bytes at ``offset`` of segment ``name``, which is in
        use (a reply the peer wrote in place into this call's argument); the segment is not
        reused while the view, or anything decoded from it, lives.

        Raises DataLossError for a segment not in use here or a range outside it.
        """
        with self._lock:
            segment = self._busy.get(name)
            if segment is None or not (segment.peer or segment.pins):
                raise DataLossError(f"a reply refers to segment {name}, which this side has not "
                                    "lent to the peer")
            segment.views += 1
        try:
            return lent_view(segment.mapping, segment.size, name, offset, length, self._unview, segment)
        except DataLossError:
            self._unview(segment)
            raise

    def _unview(self, segment: _Segment) -> None:
        with self._lock:
            segment.views -= 1
            if self._busy.get(segment.name) is segment:
                self._settle_locked(segment)

    def _settle_locked(self, segment: _Segment) -> None:
        # Back to the free list once nothing holds it.
        if segment.in_use:
            return
        del self._busy[segment.name]
        if self._closed:
            segment.drop()
            budget.give(segment.size)
            return
        self._free.append(segment)
        if len(self._free) > _MAX_FREE:
            self._evict_free_locked(keep=_MAX_FREE)

    def abandon(self, name: str) -> None:
        """The call that carried ``name`` failed: the peer may or may not map it, or may
        still be using it, so never write it again; the peer is told to forget it."""
        with self._lock:
            segment = self._busy.pop(name, None)
        if segment is not None:
            self._discard(segment)

    def _discard(self, segment: _Segment) -> None:
        with self._lock:
            self._busy.pop(segment.name, None)
        segment.drop()
        budget.give(segment.size)
        self._send_forget([segment.name])

    def close(self) -> None:
        """Drop every segment (the connection ended); the peer's mappings stay valid."""
        with self._lock:
            self._closed = True
            segments = self._free + list(self._busy.values())
            self._free, self._busy = [], {}
        for segment in segments:
            segment.drop()
            budget.give(segment.size)


def ref_triples(refs: Sequence[int], what: str) -> list[tuple[int, int, int]]:
    """The (buffer index, offset, length) triples of a header's flat ``refs``; DataLossError
    when they are not whole triples (``what``: whose references, for the message)."""
    if len(refs) % 3:
        raise DataLossError(f"{what} segment references are {len(refs)} numbers, not "
                            "(index, offset, length) triples")
    return [(refs[i], refs[i + 1], refs[i + 2]) for i in range(0, len(refs), 3)]


class _Mapped:
    __slots__ = ("mapping", "leased", "forgotten", "base")

    def __init__(self, mapping: mmap.mmap) -> None:
        self.mapping = mapping
        self.leased = False
        self.forgotten = False
        self.base = address_of(mapping)


class SegmentCache:
    """The reader's mappings of one peer's pooled segments (see the module docstring).

    ``send_release(names)`` tells the peer it may write these segments again; it may be
    called from any thread (the thread where the last view of a payload died).
    """

    def __init__(self, send_release: Callable[[list[str]], None]) -> None:
        self._send_release = send_release
        # Re-entrant: the last view of a payload may die (and run _returned) inside any
        # allocation, including one made while this thread holds the lock.
        self._lock = threading.RLock()
        self._mapped: dict[str, _Mapped] = {}
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._mapped)

    def read_refs(self, name: str, refs: Sequence[int], max_size: int) -> dict[int, memoryview]:
        """``{index: view}`` of the (index, offset, length) triples ``refs`` in a staged segment
        (shared by several readers, so not unlinked), under one lease as :meth:`read` gives."""
        triples = ref_triples(refs, "a call's")
        if not triples:
            raise DataLossError(f"a call names staged segment {name} but no bytes of it")
        total = sum(length for _, _, length in triples)
        if total > max_size:
            raise PayloadTooLargeError(f"payload of {total} bytes exceeds the maximum of {max_size} bytes",
                                       details={"size": str(total), "max_size": str(max_size)})
        end = max(offset + length for _, offset, length in triples)
        whole = self.read(name, end, unlink=False)
        return {index: whole[offset:offset + length] for index, offset, length in triples}

    def read(self, name: str, nbytes: int, max_size: int | None = None, unlink: bool = True) -> memoryview:
        """A writable view of the first ``nbytes`` of segment ``name``, mapping it the first
        time (and unlinking its file). Decode it at once; the segment goes back to the
        writer when every value viewing it is gone.

        Raises DataLossError for a name neither cached nor on disk, or one still in use;
        PayloadTooLargeError when ``nbytes`` exceeds ``max_size``.
        """
        if max_size is not None and nbytes > max_size:
            raise PayloadTooLargeError(f"payload of {nbytes} bytes exceeds the maximum of {max_size} bytes",
                                       details={"size": str(nbytes), "max_size": str(max_size)})
        with self._lock:
            entry = self._mapped.get(name)
            if entry is not None and entry.leased:
                raise DataLossError(f"shared-memory segment {name} sent again while still in use")
        if entry is None:
            view = shm.read_segment(name, unlink=unlink, max_size=None)
            if not isinstance(view.obj, mmap.mmap):
                raise DataLossError(f"shared-memory segment {name} is empty")
            entry = _Mapped(view.obj)
            view.release()
            with self._lock:
                if self._closed:
                    raise DataLossError("the call connection closed")
                self._mapped[name] = entry
        size = len(entry.mapping)
        if nbytes > size:
            raise DataLossError(f"payload of {nbytes} bytes does not fit its {size}-byte segment {name}")
        entry.leased = True
        array = (ctypes.c_ubyte * nbytes).from_buffer(entry.mapping)
        weakref.finalize(array, self._returned, name, entry)
        return memoryview(array).cast("B")

    def leased(self, name: str) -> bool:
        """Whether anything still views the payload last read from segment ``name``."""
        with self._lock:
            entry = self._mapped.get(name)
            return entry is not None and entry.leased

    def locate(self, name: str, buffers: Sequence[memoryview], min_bytes: int) -> dict[int, tuple[int, int]]:
        """``{index: (offset, length)}`` of the ``buffers`` (of at least ``min_bytes``) that
        lie inside segment ``name`` as this side mapped it: a result the method computed in
        place in its argument."""
        with self._lock:
            entry = self._mapped.get(name)
        if entry is None or not entry.base:
            return {}
        start, size = entry.base, len(entry.mapping)
        found = {}
        for index, buf in enumerate(buffers):
            if buf.nbytes < min_bytes:
                continue
            at = address_of(buf) - start
            if 0 <= at and at + buf.nbytes <= size:
                found[index] = (at, buf.nbytes)
        return found

    def peek(self, name: str, offset: int, length: int) -> memoryview:
        """Bytes of segment ``name``, which must still be leased (no lease of their own)."""
        with self._lock:
            entry = self._mapped.get(name)
            if entry is None or not entry.leased:
                raise DataLossError(f"shared-memory segment {name} is no longer in use here")
        return memoryview(entry.mapping)[offset:offset + length]

    def _returned(self, name: str, entry: _Mapped) -> None:
        with self._lock:
            entry.leased = False
            if entry.forgotten or self._closed:
                self._mapped.pop(name, None)
                return
        try:
            self._send_release([name])
        except Exception:  # noqa: BLE001 - the connection is gone: nothing to give back
            pass

    def forget(self, names: Sequence[str]) -> None:
        """The writer dropped these segments: unmap each once no value uses it."""
        with self._lock:
            for name in names:
                entry = self._mapped.get(name)
                if entry is None:
                    continue
                if entry.leased:
                    entry.forgotten = True
                else:
                    del self._mapped[name]

    def close(self) -> None:
        """Forget every segment (the connection ended); live values keep their memory."""
        with self._lock:
            self._closed = True
            self._mapped.clear()
