"""Same-host links of the weight broadcast: a bucket's bytes in shared memory, its name on the wire.

Where the sender and a replica see one ``/dev/shm`` (:func:`podium.transport.shm.domain`),
a chain link carries a bucket as the name of a segment the sender wrote once, not as its
bytes: every replica on that host maps the same segment and reads its tensors from it, and
forwards the name on to a downstream replica of the same host (or the bytes, to one that is
not). One copy into shared memory replaces a TCP stream through every replica.

The sender removes its segments once the update is acknowledged (every replica has mapped
them by then; a mapping outlives the name), and whatever happens to the update; a sender
killed first leaves them to :func:`podium.transport.shm.cleanup_stale`, which removes the
segments of dead processes.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

from podium.errors import DataLossError
from podium.transport import shm

__all__ = ["SegmentWriter", "local_domain", "map_bucket"]


def local_domain() -> str:
    """This process's shared-memory domain for the broadcast: "" (every link a TCP stream)
    under ``PODIUM_DISABLE_SHM``, as Podium's calls, or where it cannot be told."""
    return "" if os.environ.get("PODIUM_DISABLE_SHM") else shm.domain()


class SegmentWriter:
    """The sender's segments of one update: :meth:`write` one per bucket, :meth:`close` all."""

    def __init__(self) -> None:
        self._names: list[str] = []

    def write(self, pieces: list[tuple[int, Any]], size: int) -> str:
        """A new segment of ``size`` bytes holding each ``(offset, uint8 tensor)`` of
        ``pieces``; its name."""
        import torch

        with shm.new_file() as (name, fd):
            # Reserve the pages: a sparse file on a full tmpfs would SIGBUS on first touch.
            os.posix_fallocate(fd, 0, max(size, 1))
            mapping = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._names.append(name)
        target = torch.frombuffer(mapping, dtype=torch.uint8)
        for offset, flat in pieces:
            target[offset:offset + flat.numel()].copy_(flat)
        del target  # the readers map it themselves; this process needs no view
        try:
            mapping.close()
        except BufferError:  # a view torch still holds: unmapped once it is gone
            pass
        return name

    def close(self) -> None:
        """Remove every segment written (mappings in the replicas stay valid)."""
        for name in self._names:
            shm.remove_segment(name)
        self._names.clear()


def map_bucket(name: Any, nbytes: int, who: str) -> Any:
    """A uint8 tensor over the first ``nbytes`` of segment ``name`` (mapped, not copied);
    DataLossError when the segment is missing, misnamed or shorter than announced."""
    import torch

    try:
        view = shm.read_segment(name, unlink=False)
    except Exception as exc:  # noqa: BLE001 - a bad name, a gone segment: the update failed
        raise DataLossError(f"weight broadcast: {who} named shared-memory segment {name!r}, "
                            f"which cannot be mapped here: {exc}") from None
    if len(view) < nbytes:
        raise DataLossError(f"weight broadcast: {who} named segment {name} of {len(view)} bytes "
                            f"for a bucket of {nbytes}")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8, count=nbytes)
