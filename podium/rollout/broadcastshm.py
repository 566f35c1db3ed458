"""Same-host links of the weight broadcast: a bucket's bytes in shared memory, its name on the wire.

Where the sender and a replica see one ``/dev/shm`` (:func:`podium.transport.shm.domain`),
a chain link carries a bucket as the name of a segment the sender wrote once, not as its
bytes: every replica on that host maps the same segment and reads its tensors from it, and
forwards the name on to a downstream replica of the same host (or the bytes, to one that is
not). One copy into shared memory replaces a TCP stream through every replica.

The sender keeps its segments from one update to the next (same bucket sizes: the same
segments, rewritten) and each replica keeps its mappings, so after the first update a bucket
costs one copy in and one copy out, with no page faults. Segments go when the sender's
process exits, or, when it is killed, by :func:`podium.transport.shm.cleanup_stale`, which
removes the segments of dead processes (node agents run it).
"""

from __future__ import annotations

import atexit
import mmap
import os
import threading
from typing import Any

from podium.errors import DataLossError
from podium.transport import shm

__all__ = ["SENDER", "SENDER_LOCK", "SegmentWriter", "local_domain", "map_bucket"]


def local_domain() -> str:
    """This process's shared-memory domain for the broadcast: "" (every link a TCP stream)
    under ``PODIUM_DISABLE_SHM``, as Podium's calls, or where it cannot be told."""
    return "" if os.environ.get("PODIUM_DISABLE_SHM") else shm.domain()


class SegmentWriter:
    """The sender's segments, one per bucket of the update, kept for the next update of the
    same layout: a new segment costs the kernel its pages (zeroed, then faulted in by every
    reader), a kept one only the copy. Not thread-safe: the module's :data:`SENDER` is used
    under :data:`SENDER_LOCK`."""

    def __init__(self) -> None:
        self._segments: list[tuple[str, int, Any]] = []  # (name, size, uint8 tensor over its mapping)

    def write(self, index: int, pieces: list[tuple[int, Any]], size: int) -> str:
        """Bucket ``index`` of ``size`` bytes holding each ``(offset, uint8 tensor)`` of
        ``pieces``, in the segment bucket ``index`` had last time when its size matches
        (else a new one); the segment's name."""
        import torch

        if index < len(self._segments) and self._segments[index][1] == size:
            name, _, target = self._segments[index]
        else:
            with shm.new_file() as (name, fd):
                # Reserve the pages: a sparse file on a full tmpfs would SIGBUS on first touch.
                os.posix_fallocate(fd, 0, max(size, 1))
                mapping = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
            target = torch.frombuffer(mapping, dtype=torch.uint8)
            if index < len(self._segments):
                shm.remove_segment(self._segments[index][0])
                self._segments[index] = (name, size, target)
            else:
                self._segments.append((name, size, target))
        for offset, flat in pieces:
            target[offset:offset + flat.numel()].copy_(flat)
        return name

    def trim(self, count: int) -> None:
        """Remove the segments past the first ``count`` (a smaller update than the last)."""
        for name, _, _ in self._segments[count:]:
            shm.remove_segment(name)
        del self._segments[count:]

    def close(self) -> None:
        """Remove every segment (mappings in the replicas stay valid)."""
        self.trim(0)


#: This process's sender segments (a trainer rank sends one update at a time).
SENDER = SegmentWriter()
#: Held while an update writes :data:`SENDER`.
SENDER_LOCK = threading.Lock()
atexit.register(SENDER.close)


def map_bucket(name: Any, nbytes: int, who: str) -> Any:
    """A uint8 tensor over the first ``nbytes`` of segment ``name`` (mapped, not copied);
    DataLossError when the segment is missing, misnamed or shorter than announced."""
    import torch

    try:
        view = shm.read_segment(name, unlink=False, writable=False)  # the sender's: never written here
    except Exception as exc:  # noqa: BLE001 - a bad name, a gone segment: the update failed
        raise DataLossError(f"weight broadcast: {who} named shared-memory segment {name!r}, "
                            f"which cannot be mapped here: {exc}") from None
    if len(view) < nbytes:
        raise DataLossError(f"weight broadcast: {who} named segment {name} of {len(view)} bytes "
                            f"for a bucket of {nbytes}")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8, count=nbytes)
