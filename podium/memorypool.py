"""Memory for large received payloads and gathered results, reused from one step to the next.

Receiving is cheap; fresh memory is not. Measured on the 2-core machines Podium targets,
the first touch of a new 128 MiB allocation costs ~180 ms (the kernel hands out and zeroes
32,768 pages, ~5 us each; transparent huge pages are not available there), while copying
into memory touched before costs ~8 ms and loopback TCP moves the same bytes in ~65 ms.
``malloc`` returns blocks this large to the kernel on free, so a training loop that
receives a batch of the same size every step would pay for fresh pages every step.

:class:`MemoryPool` keeps those pages: :meth:`take` hands out an anonymous mapping
(reused when one of the right size is free), the receiver fills it (``recv_into``
straight from the socket), and :meth:`lease` turns it into a writable view that the
codec decodes zero-copy. When the last value viewing a lease dies (``weakref.finalize``
on the view's ctypes array, any thread), the mapping goes back on the free list. Free
mappings are bounded (:func:`idle_budget` bytes, least recently used dropped first), so
the pool never keeps more than that beyond what live values hold anyway. The call
socket receives bulk payloads into it (:mod:`podium.transport.callsocket`) and the
concatenation of a group's results lands in it (:mod:`podium.rowcat`).

A new mapping is committed page by page as data arrives, so a peer that announces a
large payload and sends little holds little memory (see
:mod:`podium.transport.chunks`). A receiver may tag the mappings a connection filled
(:meth:`MemoryPool.fill_for`); when that connection ends (:meth:`MemoryPool.release_pages_of`)
their pages go back to the kernel (``madvise(MADV_DONTNEED)``: the mapping stays for reuse,
its memory does not), so a peer that leaves does not leave its pages resident for the
pool's idle budget.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = ["MemoryPool", "POOL", "idle_budget", "MIN_POOLED_BYTES", "copy_segments", "move"]

# Mappings are a multiple of this, so payloads whose size varies a little (another
# skeleton length, a few more rows) reuse the mapping of the previous step.
_GRANULE = 1 << 20

#: The smallest buffer worth a mapping of this pool (a received payload, a reply's copy,
#: concatenated rows); smaller ones use plain ``bytearray``s: fresh pages are cheap at that
#: size and a mapping is at least one granule. A rule of the pool, not of the wire: the
#: transport's own sizes (chunks, frames, bulk frames, shared-memory references) are its own.
MIN_POOLED_BYTES = _GRANULE
# Copies at least this large are split between two threads (move).
_PARALLEL_MOVE_BYTES = 16 << 20
# A free mapping serves a request this much smaller at most (beyond, a new one is made).
_MAX_SLACK = 2


def idle_budget() -> int:
    """Bytes of free mappings a process keeps: ``PODIUM_RECEIVE_POOL_BYTES``, else an
    eighth of physical memory up to 4 GiB."""
    value = os.environ.get("PODIUM_RECEIVE_POOL_BYTES")
    if value:
        return max(0, int(value))
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        physical = 8 << 30
    return min(physical // 8, 4 << 30)


def copy_segments(target: Any, segments: Sequence[Any]) -> int:
    """Copy the concatenation of ``segments`` to the start of the writable buffer ``target``
    (a mapping, a bytearray); returns the bytes copied.

    The copy runs without the GIL, so threads (the ranks of a fan-out, an execution thread
    beside the event loop) copy in parallel; a large one is split between two threads
    (:func:`move`).
    """
    import numpy as np

    dest = np.frombuffer(target, dtype=np.uint8)
    at = 0
    moves = []
    for segment in segments:
        view = memoryview(segment)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        size = view.nbytes
        if size:
            if at + size > dest.nbytes:
                raise ValueError(f"{at + size} bytes do not fit a {dest.nbytes}-byte buffer")
            moves.append((dest[at:].ctypes.data, np.frombuffer(view, dtype=np.uint8).ctypes.data, size))
        at += size
    move(moves)
    return at


def move(moves: Sequence[tuple[int, int, int]]) -> None:
    """``memmove`` each (destination address, source address, length); a total of at least
    16 MiB is split between this thread and a helper, half of the bytes each.

    One core's copy does not saturate memory: 128 MiB took 12 ms with two threads against
    15 ms with one on the 2-core machines Podium targets. The caller keeps both ends alive.
    """
    total = sum(n for _, _, n in moves)
    if total < _PARALLEL_MOVE_BYTES:
        _move(moves)
        return
    room, first, second = total // 2, [], []
    for dst, src, n in moves:
        take = min(room, n)
        if take:
            first.append((dst, src, take))
            room -= take
        if take < n:
            second.append((dst + take, src + take, n - take))
    helper = threading.Thread(target=_move, args=(first,), name="podium-copy", daemon=True)
    helper.start()
    try:
        _move(second)
    finally:
        helper.join()


def _move(moves: Sequence[tuple[int, int, int]]) -> None:
    for dst, src, n in moves:  # ctypes releases the GIL for the call
        ctypes.memmove(dst, src, n)


def _drop_pages(buffer: mmap.mmap) -> None:
    # Anonymous private memory reads as zeros afterwards: the next fill commits fresh pages.
    try:
        buffer.madvise(mmap.MADV_DONTNEED)
    except (OSError, ValueError):  # closed meanwhile, or a kernel without it: nothing to do
        pass


def _rounded(nbytes: int) -> int:
    return max(_GRANULE, (nbytes + _GRANULE - 1) // _GRANULE * _GRANULE)


class MemoryPool:
    """Reused anonymous mappings for received payloads (see the module docstring).

    Thread-safe: a lease may end on any thread.
    """

    def __init__(self, idle_limit: int | None = None) -> None:
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []  # least recently returned first
        self._idle = 0
        self._limit = idle_limit
        # id(mapping) -> the key of the connection that last filled it (fill_for); and the
        # ids of leased mappings whose connection ended (their pages go when they come back).
        self._filler: dict[int, object] = {}
        self._orphans: set[int] = set()
        #: Mappings made and reuses served (tests and stats).
        self.created = 0
        self.reused = 0

    @property
    def idle_bytes(self) -> int:
        """Bytes of free mappings kept for reuse."""
        return self._idle

    def take(self, nbytes: int) -> mmap.mmap:
        """A writable mapping of at least ``nbytes``: a free one that fits, else a new one."""
        need = _rounded(nbytes)
        with self._lock:
            best = -1
            for i, buffer in enumerate(self._free):
                size = len(buffer)
                if need <= size <= need * _MAX_SLACK and (best < 0 or size < len(self._free[best])):
                    best = i
            if best >= 0:
                buffer = self._free.pop(best)
                self._idle -= len(buffer)
                self._filler.pop(id(buffer), None)  # whoever fills it now tags it anew
                self._orphans.discard(id(buffer))
                self.reused += 1
                return buffer
            self.created += 1
        return mmap.mmap(-1, need)

    def fill_for(self, buffer: mmap.mmap, key: object) -> None:
        """Tag ``buffer`` as filled by the connection ``key`` (see :meth:`release_pages_of`)."""
        with self._lock:
            self._filler[id(buffer)] = key
            self._orphans.discard(id(buffer))

    def release_pages_of(self, key: object) -> int:
        """The connection ``key`` ended: the free mappings it filled give their pages back to
        the kernel now, the ones still leased when they come back. Returns the bytes released."""
        with self._lock:
            free = {id(buffer): buffer for buffer in self._free}
            mine = [ident for ident, filler in self._filler.items() if filler is key]
            released = []
            for ident in mine:
                del self._filler[ident]
                if ident in free:
                    released.append(free[ident])
                else:
                    self._orphans.add(ident)
        for buffer in released:
            _drop_pages(buffer)
        return sum(len(buffer) for buffer in released)

    @staticmethod
    def drop_pages(buffer: mmap.mmap) -> None:
        """Give ``buffer``'s pages back to the kernel now (it reads as zeros afterwards)."""
        _drop_pages(buffer)

    def give_back(self, buffer: mmap.mmap) -> None:
        """Return a mapping nobody views (a receive that ended early, or a finished lease)."""
        if buffer.closed:
            return
        drop: list[mmap.mmap] = []
        with self._lock:
            if id(buffer) in self._orphans:
                self._orphans.discard(id(buffer))
                _drop_pages(buffer)
            if self._limit is None:
                self._limit = idle_budget()
            self._free.append(buffer)
            self._idle += len(buffer)
            while self._idle > self._limit and self._free:
                old = self._free.pop(0)
                self._idle -= len(old)
                self._filler.pop(id(old), None)
                drop.append(old)
        for old in drop:
            try:
                old.close()
            except BufferError:  # still exported somewhere: the last reference frees it
                pass

    def lease(self, buffer: mmap.mmap, nbytes: int) -> memoryview:
        """A writable view of the first ``nbytes`` of ``buffer``; the mapping returns to the
        free list when every value viewing it is gone."""
        array = (ctypes.c_ubyte * nbytes).from_buffer(buffer)
        weakref.finalize(array, self.give_back, buffer)
        return memoryview(array).cast("B")

    def clear(self) -> None:
        """Drop every free mapping (tests; live leases are untouched)."""
        with self._lock:
            free, self._free, self._idle = self._free, [], 0
            for buffer in free:
                self._filler.pop(id(buffer), None)
        for buffer in free:
            try:
                buffer.close()
            except BufferError:
                pass


#: The process's pool: every connection's large payloads, both directions, and gathered results.
POOL = MemoryPool()
