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
  (``HostRuntime.package``), decoded here as views of it (:meth:`SegmentPool.view`). So
  the writer pins a call's argument segment until its reply is decoded (the reader's
  release of it may arrive first), and a segment goes back to the free list only once
  it is released, unpinned and no view of it is left.

Both classes are thread-safe: a worker's result is written on its execution thread and
the last view of a lease may die on any thread. Messages to the peer go through the
``send`` callback given to each, which must itself be safe to call from any thread.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from podium.memorypool import copy_segments
from podium.transport import shm
from podium.errors import DataLossError, PayloadTooLargeError

__all__ = ["SegmentPool", "SegmentCache", "SharedSegments", "pool_budget", "address_of", "lent_view",
           "create_segment", "drop_segment", "budget", "GRANULE", "REF_MIN_BYTES", "ref_triples"]

# Segments are made a multiple of this, so batches whose size varies a little (another
# skeleton length, a few more rows) still fit the segment of the previous step.
GRANULE = 1 << 20
# Free segments a pool keeps for reuse; more are forgotten (least recently released first).
_MAX_FREE = 2
# Whole segments a pool may have at once (free + in the peer's hands).
_MAX_SEGMENTS = 8


def pool_budget() -> int:
    """Bytes of pooled segments one process may hold: ``PODIUM_SHM_POOL_BYTES``, else a
    quarter of ``/dev/shm`` (Docker's default 64 MiB /dev/shm gets 16 MiB) up to 8 GiB."""
    value = os.environ.get("PODIUM_SHM_POOL_BYTES")
    if value:
        return int(value)
    try:
        info = os.statvfs(shm.SHM_DIR)
    except OSError:
        return 0
    return min(info.f_blocks * info.f_frsize // 4, 8 << 30)


class _Budget:
    """Pooled bytes of this process, shared by every pool (one per connection)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.used = 0
        self.limit: int | None = None

    def take(self, size: int) -> bool:
        with self.lock:
            if self.limit is None:
                self.limit = pool_budget()
            if self.used + size > self.limit:
                return False
            self.used += size
            return True

    def give(self, size: int) -> None:
        with self.lock:
            self.used -= size


budget = _Budget()


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
        try:
            self.mapping.close()
        except BufferError:  # a copy into it is still running; unmapped when it ends
            pass


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
        size = -(-nbytes // GRANULE) * GRANULE
        if not budget.take(size):
            self._evict_all_free()  # make room for the next call
            if not budget.take(size):
                return None
        try:
            segment = create_segment(size)
        except BaseException:
            budget.give(size)
            raise
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


#: Buffers at least this large travel as references into a shared segment (a group call's
#: staged arguments, a result written in place); smaller ones are cheaper to copy.
REF_MIN_BYTES = 1 << 16


def ref_triples(refs: Sequence[int], what: str) -> list[tuple[int, int, int]]:
    """The (buffer index, offset, length) triples of a header's flat ``refs``; DataLossError
    when they are not whole triples (``what``: whose references, for the message)."""
    if len(refs) % 3:
        raise DataLossError(f"{what} segment references are {len(refs)} numbers, not "
                            "(index, offset, length) triples")
    return [(refs[i], refs[i + 1], refs[i + 2]) for i in range(0, len(refs), 3)]


def lent_view(mapping: mmap.mmap, size: int, name: str, offset: int, length: int,
              on_dead: Callable[[Any], None], holder: Any) -> memoryview:
    """A writable view of ``length`` bytes at ``offset`` of segment ``name`` (``size`` bytes
    mapped at ``mapping``) that calls ``on_dead(holder)`` once it, and everything made from
    it, is gone. DataLossError for a range outside the segment (a peer's bad reference)."""
    if offset < 0 or length < 0 or offset + length > size:
        raise DataLossError(f"a reply refers to bytes {offset}..{offset + length} of the "
                            f"{size}-byte segment {name}")
    array = (ctypes.c_ubyte * length).from_buffer(mapping, offset)
    weakref.finalize(array, on_dead, holder)
    return memoryview(array).cast("B")


def drop_segment(name: str, size: int, mapping: mmap.mmap) -> None:
    """Unlink a segment this process created, give its bytes back to the budget, and unmap it
    (at once, or when the last view of it dies)."""
    shm.remove_segment(name)
    try:
        mapping.close()
    except BufferError:  # still viewed: unmapped when the views die
        pass
    budget.give(size)


def create_segment(size: int) -> _Segment:
    """A new segment of ``size`` bytes in ``/dev/shm``, its pages reserved and mapped."""
    name = f"{shm.PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    path = os.path.join(shm.SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # Reserve the pages now: a sparse file on a full tmpfs would SIGBUS on first touch.
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return _Segment(name, size, mapping)


class _Mapped:
    __slots__ = ("mapping", "leased", "forgotten", "base")

    def __init__(self, mapping: mmap.mmap) -> None:
        self.mapping = mapping
        self.leased = False
        self.forgotten = False
        self.base = address_of(mapping)


def address_of(buffer: Any) -> int:
    """The address of a writable buffer's first byte (0 when it is read-only or empty)."""
    try:
        probe = ctypes.c_char.from_buffer(buffer)
    except (TypeError, ValueError):
        return 0
    address = ctypes.addressof(probe)
    del probe  # releases the export, so the buffer can be closed again
    return address


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


class SharedSegments:
    """Both halves for one call connection: the :class:`SegmentPool` this side writes and
    the :class:`SegmentCache` of the peer's segments, plus the bookkeeping frames between them.

    ``make_frame(**fields)`` builds this side's frame type (CallFrame or ReplyFrame) and
    ``send(frame)`` queues it on the connection; both run on ``loop``. Pools and caches
    call back from any thread, so their messages hop onto the loop first.
    """

    def __init__(self, loop: Any, make_frame: Callable[..., Any], send: Callable[[Any], None]) -> None:
        self._loop = loop
        self._make_frame = make_frame
        self._send = send
        self.closed = False
        #: What this side writes for the peer.
        self.pool = SegmentPool(lambda names: self._queue(forget=names))
        #: What the peer wrote for this side.
        self.cache = SegmentCache(lambda names: self._queue(released=names))

    def _queue(self, released: Sequence[str] = (), forget: Sequence[str] = ()) -> None:
        if self.closed:
            return
        try:
            self._loop.call_soon_threadsafe(self._write, list(released), list(forget))
        except RuntimeError:  # the loop is closed: so is the connection
            pass

    def _write(self, released: list[str], forget: list[str]) -> None:
        if not self.closed:
            # call id 0: a frame that carries only segment bookkeeping
            self._send(self._make_frame(call_id=0, shm_released=released, shm_forget=forget))

    def forget_foreign(self, names: Sequence[str]) -> None:
        """Tell the peer to forget segments this side dropped that are not the pool's (staged
        ones, :mod:`podium.transport.shmstage`). Safe on any thread."""
        self._queue(forget=names)

    def on_frame(self, frame: Any) -> None:
        """Apply a received frame's ``shm_released`` (to the pool, or to the staged segments
        for names not its own) and ``shm_forget`` (to the cache)."""
        if frame.shm_released:
            foreign = self.pool.release(list(frame.shm_released))
            if foreign:
                from podium.transport.shmstage import STAGE  # imports this module

                for name in foreign:
                    STAGE.release(name, self)
        if frame.shm_forget:
            self.cache.forget(list(frame.shm_forget))

    def close(self) -> None:
        """The connection ended: drop the pool's segments and forget the peer's (and the
        staged segments the peer held are its no more)."""
        self.closed = True
        self.pool.close()
        self.cache.close()
        from podium.transport.shmstage import STAGE  # imports this module

        STAGE.link_closed(self)
