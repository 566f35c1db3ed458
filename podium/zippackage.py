"""A package zip (a job's ``working_dir`` or ``py_modules``) checked and unpacked safely.

Every entry's path is relative, without ``..``, backslash or NUL, and names a file or folder
(no links, devices or pipes); the entries are at most :data:`MAX_PACKAGE_ENTRIES` and unpack
to at most :data:`MAX_UNPACKED_BYTES`. The scheduler checks a package when it is uploaded
(:mod:`podium.scheduler.jobpackages`); the node agent checks it again where it unpacks it for
a driver placed on its node.
"""

from __future__ import annotations

import os
import re
import stat
import zipfile
from pathlib import Path, PurePosixPath

from podium.errors import InvalidArgumentError, PayloadTooLargeError

__all__ = ["MAX_UNPACKED_BYTES", "MAX_PACKAGE_BYTES", "MAX_PACKAGE_ENTRIES", "MAX_DRIVER_PACKAGES_BYTES", "check_zip", "unpack"]

#: Largest sum of a package's unpacked file sizes, and most entries in one.
MAX_UNPACKED_BYTES = 1024 * 1024 * 1024
#: Largest package (Ray's own limit is its gRPC message size, 512 MiB): an upload to the
#: scheduler, and a package a node fetches for a worker's runtime_env.
MAX_PACKAGE_BYTES = 256 * 1024 * 1024
MAX_PACKAGE_ENTRIES = 100_000
#: A job's packages together when its driver runs on another node: they travel in one gRPC
#: message (whose limit is 64 MiB) to that node's agent.
MAX_DRIVER_PACKAGES_BYTES = 48 * 1024 * 1024


def _entry_path(info: zipfile.ZipInfo) -> PurePosixPath | None:
    """The checked relative path of an entry (None for the root itself)."""
    name = info.filename
    if "\\" in name or "\x00" in name:
        raise InvalidArgumentError(f"package entry {name!r} has a backslash or NUL in its path")
    path = PurePosixPath(name)
    if path.is_absolute() or re.match(r"^[A-Za-z]:", name):
        raise InvalidArgumentError(f"package entry {name!r} is an absolute path")
    if ".." in path.parts:
        raise InvalidArgumentError(f"package entry {name!r} leaves its folder ('..')")
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        raise InvalidArgumentError(f"package entry {name!r} is a symbolic link; packages hold files "
                                   f"and folders only")
    kind = stat.S_IFMT(mode)  # 0 where the zip tool recorded permissions only
    if kind and kind not in (stat.S_IFREG, stat.S_IFDIR):
        raise InvalidArgumentError(f"package entry {name!r} is not a file or folder")
    return path if path.parts else None


def check_zip(path: str | os.PathLike) -> int:
    """Check a package file (see the module); returns its unpacked size in bytes."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            if len(infos) > MAX_PACKAGE_ENTRIES:
                raise PayloadTooLargeError(f"package has {len(infos)} entries; at most {MAX_PACKAGE_ENTRIES}")
            total = 0
            for info in infos:
                _entry_path(info)
                total += info.file_size
            if total > MAX_UNPACKED_BYTES:
                raise PayloadTooLargeError(f"package unpacks to {total} bytes; at most {MAX_UNPACKED_BYTES}")
            return total
    except zipfile.BadZipFile as exc:
        raise InvalidArgumentError(f"package is not a zip file ({exc})") from None


def unpack(package: str | os.PathLike, target: str | os.PathLike) -> None:
    """Unpack a checked package into ``target`` (made), entry by entry: each file at its
    checked path, written no larger than its declared size (zipfile stops there)."""
    root = Path(target)
    root.mkdir(parents=True, exist_ok=True)
    check_zip(package)
    with zipfile.ZipFile(package) as archive:
        for info in archive.infolist():
            rel = _entry_path(info)
            if rel is None:
                continue
            dest = root.joinpath(*rel.parts)
            if info.is_dir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.is_symlink() or (dest.exists() and not dest.is_file()):
                raise InvalidArgumentError(f"package entry {info.filename!r} collides with a folder")
            with archive.open(info) as src, open(dest, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(dest, (mode & 0o755) | 0o600 if mode else 0o644)
