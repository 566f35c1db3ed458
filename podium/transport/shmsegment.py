"""The memory under reusable shared-memory segments: the process's budget for them, making
one, views of one that say when they die, and dropping one.

A connection's pooled segments (:mod:`podium.transport.shmpool`) and a group call's staged
ones (:mod:`podium.transport.shmstage`) are both made and dropped here and share one budget,
so neither module needs the other.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from podium.errors import DataLossError
from podium.transport import shm

__all__ = ["GRANULE", "pool_budget", "budget", "rounded", "create_segment", "close_mapping", "drop_segment",
           "lent_view", "address_of"]

# Segments are made a multiple of this, so batches whose size varies a little (another
# skeleton length, a few more rows) still fit the segment of the previous step.
GRANULE = 1 << 20


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
    """Bytes of reusable segments this process holds, shared by every pool (one per
    connection) and the staged segments. ``limit`` is :func:`pool_budget` until set."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.used = 0
        self.limit: int | None = None

    def take(self, size: int) -> bool:
        """Count ``size`` bytes more; False (nothing counted) when that would pass the limit."""
        with self.lock:
            if self.limit is None:
                self.limit = pool_budget()
            if self.used + size > self.limit:
                return False
            self.used += size
            return True

    def give(self, size: int) -> None:
        """Give back ``size`` bytes taken earlier."""
        with self.lock:
            self.used -= size


#: The process's budget.
budget = _Budget()


def rounded(nbytes: int) -> int:
    """The size of the segment made for ``nbytes``: the next multiple of :data:`GRANULE`."""
    return -(-nbytes // GRANULE) * GRANULE


def create_segment(size: int) -> tuple[str, mmap.mmap]:
    """A new segment of ``size`` bytes in ``/dev/shm``, its pages reserved and mapped:
    ``(name, mapping)``. The caller has taken ``size`` from :data:`budget`."""
    with shm.new_file() as (name, fd):
        # Reserve the pages now: a sparse file on a full tmpfs would SIGBUS on first touch.
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return name, mapping


def close_mapping(mapping: mmap.mmap) -> None:
    """Unmap ``mapping`` now, or, while a copy into it runs or a value views it, when the
    last of those ends."""
    try:
        mapping.close()
    except BufferError:
        pass


def drop_segment(name: str, size: int, mapping: mmap.mmap) -> None:
    """Unlink a segment this process created, give its bytes back to the budget, and unmap it
    (at once, or when the last view of it dies)."""
    shm.remove_segment(name)
    close_mapping(mapping)
    budget.give(size)


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


def address_of(buffer: Any) -> int:
    """The address of a writable buffer's first byte (0 when it is read-only or empty)."""
    try:
        probe = ctypes.c_char.from_buffer(buffer)
    except (TypeError, ValueError):
        return 0
    address = ctypes.addressof(probe)
    del probe  # releases the export, so the buffer can be closed again
    return address
