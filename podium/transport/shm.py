"""Same-host shared-memory segments: the fast path for payloads between processes
on one machine.

The writer copies a payload's segments once into a new file in ``/dev/shm``
(POSIX shared memory on Linux) named ``podium-<creator pid>-<uuid>`` and sends
only the name. The reader maps the file and unlinks it at once, so the segment
disappears even if either process later crashes; the mapping stays valid for as
long as anything (a decoded tensor) still views it. Segments whose reader never
came are removed by :func:`cleanup_stale` once their creator has died.

Files are created directly (not with ``multiprocessing.shared_memory``), because
multiprocessing's resource tracker warns about and unlinks segments that another
process has taken over. Where ``/dev/shm`` does not exist the system temporary
directory is used instead (still same-host, just not guaranteed RAM-backed).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
import tempfile
import uuid
from collections.abc import Iterable, Iterator

from podium.errors import DataLossError, InvalidArgumentError, PayloadTooLargeError

__all__ = ["PREFIX", "SHM_DIR", "DEFAULT_SHM_THRESHOLD_BYTES", "domain", "write_segments", "new_file", "read_segment", "remove_segment",
           "cleanup_stale", "remove_segments_of"]

#: Payloads at least this large go through shared memory between processes on one host
#: (both ways; ``PODIUM_SHM_THRESHOLD_BYTES`` overrides it in the clients and the workers);
#: smaller ones are cheaper inline.
DEFAULT_SHM_THRESHOLD_BYTES = 1 << 20
#: Every segment name starts with this, followed by "<creator pid>-<uuid hex>".
PREFIX = "podium-"
#: Where segments live.
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

# Names arrive over the wire: allow nothing that could leave SHM_DIR.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,254}$")


def domain() -> str:
    """Who else can see this process's segments: boot id + device + inode of SHM_DIR.

    Two processes can pass segments by name exactly when their domains are equal. A
    host name does not say that: containers on the host network share one host name
    but may each have a private /dev/shm. "" when it cannot be told (never shared).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
        info = os.stat(SHM_DIR)
    except OSError:
        return ""
    return f"{boot}:{info.st_dev}:{info.st_ino}"


def _path(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or not name.startswith(PREFIX):
        raise InvalidArgumentError(f"not a Podium shared-memory segment name: {name!r}")
    return os.path.join(SHM_DIR, name)


def write_segments(segments: Iterable[bytes | bytearray | memoryview]) -> tuple[str, int]:
    """Copy the concatenation of ``segments`` into a new segment; return (name, size).

    The caller passes the name to the reader, which unlinks it; if the reader
    will never come (the call failed), call :func:`remove_segment`.
    """
    size = 0
    with new_file() as (name, fd):
        for segment in segments:
            view = memoryview(segment)
            if view.ndim != 1 or view.itemsize != 1:
                view = view.cast("B")
            while view.nbytes:
                written = os.write(fd, view)
                size += written
                view = view[written:]
    return name, size


@contextlib.contextmanager
def new_file() -> Iterator[tuple[str, int]]:
    """A new segment file of this process, open for reading and writing: ``(name, fd)``. The
    descriptor is closed when the block ends, and the file removed if the block raised."""
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        yield name, fd
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def read_segment(name: str, unlink: bool = True, max_size: int | None = None,
                 writable: bool = True) -> memoryview:
    """Map segment ``name`` (writable, private to this reader once unlinked).

    With ``unlink`` (the default) the file is removed right after mapping, so it
    cannot leak. Raises DataLossError if the segment does not exist (already
    read, or cleaned up) or is not a segment of this user (issue #48: a symlink, or a
    file another user planted, is never mapped), PayloadTooLargeError above ``max_size``.
    Without ``writable`` the file is opened read-only and mapped copy-on-write: a reader
    that writes into what it was handed changes its own pages, never the file.
    """
    path = _path(name)
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise DataLossError(f"shared-memory segment {name} does not exist (already read or "
                            f"removed)") from exc
    except OSError as exc:  # ELOOP: a symlink
        raise DataLossError(f"shared-memory segment {name} cannot be opened: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_dev != os.stat(SHM_DIR).st_dev:
            unlink = False  # not ours to remove either
            raise DataLossError(f"shared-memory segment {name} is not a file of this user in {SHM_DIR}")
        size = info.st_size
        if max_size is not None and size > max_size:
            raise PayloadTooLargeError(
                f"payload of {size} bytes exceeds the maximum of {max_size} bytes",
                details={"size": str(size), "max_size": str(max_size)})
        flags = mmap.MAP_SHARED if writable else mmap.MAP_PRIVATE
        mapped = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else None
    finally:
        os.close(fd)  # the mapping does not need the descriptor
        if unlink:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return memoryview(mapped) if mapped is not None else memoryview(bytearray())


def remove_segment(name: str) -> bool:
    """Unlink segment ``name`` if it still exists; True if it did."""
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Remove segments named ``<prefix><pid>-...`` whose creator pid is dead.

    Returns the names removed. A recycled pid keeps its segments until that
    process dies too; processes in another pid namespace sharing this
    ``/dev/shm`` are not told apart (use one prefix per namespace there).
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        pid_text = name[len(prefix):].split("-", 1)[0]
        if not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            continue  # its reader or another cleaner got there first
        removed.append(name)
    return removed


def remove_segments_of(pid: int, prefix: str = PREFIX) -> list[str]:
    """Remove every segment process ``pid`` created; returns the names removed.

    For the parent that has just reaped ``pid`` (the node agent, when a worker
    ends): whatever that process wrote and no reader mapped is garbage now.
    """
    start = f"{prefix}{int(pid)}-"
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        if name.startswith(start):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                continue
            removed.append(name)
    return removed
