"""The packages a job's ``working_dir`` and ``py_modules`` arrive in: stored, checked, unpacked.

Ray's client zips a local directory, names it by its content's hash
(``_ray_pkg_<hash>.zip``), asks ``GET /api/packages/gcs/<name>`` whether the cluster has it,
``PUT``\\ s it if not, and submits the job with ``runtime_env={"working_dir":
"gcs://_ray_pkg_<hash>.zip"}``. Here a package is a file in the scheduler's jobs folder.

A package is checked whole when it is uploaded, before it is kept: its size
(:data:`MAX_PACKAGE_BYTES`, also enforced before the body is read), its entry count and
unpacked size (:data:`MAX_PACKAGE_ENTRIES`, :data:`MAX_UNPACKED_BYTES`), and every path in it
(relative, no ``..``, no links: nothing unpacks outside its folder). Stored packages together
stay under :data:`MAX_STORED_BYTES`: the least recently used ones that no live job needs go.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterable
from pathlib import Path

from podium.errors import InvalidArgumentError, NotFoundError, PayloadTooLargeError
from podium.zippackage import MAX_PACKAGE_BYTES, MAX_PACKAGE_ENTRIES, MAX_UNPACKED_BYTES, check_zip, unpack
from podium.private import open_private, private_dir

__all__ = ["PackageStore", "check_zip", "unpack", "package_name_of", "MAX_PACKAGE_BYTES",
           "MAX_UNPACKED_BYTES", "MAX_PACKAGE_ENTRIES", "MAX_STORED_BYTES"]

#: Stored packages together, at most.
MAX_STORED_BYTES = 2 * 1024 * 1024 * 1024
#: What Ray's clients upload: a zip named by its hash (``gcs`` is the protocol they use).
_NAME = re.compile(r"^_ray_pkg_[0-9a-f]{16,64}\.zip$")
_PROTOCOL = "gcs"


def package_name_of(uri: str) -> str:
    """``_ray_pkg_<hash>.zip`` of a ``gcs://`` URI; InvalidArgumentError for any other URI."""
    protocol, sep, name = uri.partition("://")
    if not sep or protocol != _PROTOCOL or not _NAME.match(name):
        raise InvalidArgumentError(
            f"package URI {uri!r} is not supported: Podium takes packages uploaded to the cluster "
            f"(gcs://_ray_pkg_<hash>.zip, which `ray job submit --working-dir DIR` and "
            f"`podium job submit --working-dir DIR` make from a local directory)")
    return name


def _check_name(protocol: str, name: str) -> None:
    if protocol != _PROTOCOL or not _NAME.match(name):
        raise InvalidArgumentError(f"package {protocol}://{name} is not a name Podium stores: it takes "
                                   f"gcs://_ray_pkg_<hex hash>.zip")


class PackageStore:
    """Uploaded packages in ``folder`` (made private), least recently used first out."""

    def __init__(self, folder: str | os.PathLike, *, max_stored_bytes: int = MAX_STORED_BYTES) -> None:
        self.folder = Path(folder)
        private_dir(str(self.folder))
        self.max_stored_bytes = max_stored_bytes
        self._uploads = itertools.count()

    def path(self, name: str) -> Path:
        """Where package ``name`` is (or would be) kept."""
        return self.folder / name

    def exists(self, protocol: str, name: str) -> bool:
        """Whether ``protocol://name`` was uploaded (and marks it used: it is kept longer)."""
        _check_name(protocol, name)
        path = self.path(name)
        if not path.is_file():
            return False
        os.utime(path)
        return True

    def require(self, uri: str) -> Path:
        """The stored file of a ``gcs://`` URI; NotFoundError when it was never uploaded."""
        name = package_name_of(uri)
        path = self.path(name)
        if not path.is_file():
            raise NotFoundError(f"package {uri} does not exist on this cluster; upload it first "
                                f"(PUT /api/packages/gcs/{name}, which the job clients do for a "
                                f"local working_dir)")
        os.utime(path)
        return path

    def put(self, protocol: str, name: str, data: bytes, in_use: Iterable[str] = ()) -> None:
        """Check and keep one package from bytes (see :meth:`adopt`)."""
        _check_name(protocol, name)
        if len(data) > MAX_PACKAGE_BYTES:
            raise PayloadTooLargeError(f"package is {len(data)} bytes; at most {MAX_PACKAGE_BYTES}")
        staged = self.staging(name)
        try:
            with open_private(staged, "wb") as out:
                out.write(data)
            self.adopt(protocol, name, staged, in_use)
        finally:
            staged.unlink(missing_ok=True)

    def staging(self, name: str) -> Path:
        """A fresh file name an upload of ``name`` is written to before :meth:`adopt`."""
        return self.folder / f".{name}.{os.getpid()}.{next(self._uploads)}.part"

    def adopt(self, protocol: str, name: str, staged: Path, in_use: Iterable[str] = ()) -> None:
        """Check the uploaded file ``staged`` and keep it as package ``protocol://name``
        (replacing one of the same name); older packages no live job needs go to stay under
        the stored bound. Blocking file work: call it off the loop."""
        _check_name(protocol, name)
        size = staged.stat().st_size
        if size > MAX_PACKAGE_BYTES:
            raise PayloadTooLargeError(f"package is {size} bytes; at most {MAX_PACKAGE_BYTES}")
        check_zip(staged)
        self._make_room(size, set(in_use) | {name})
        os.replace(staged, self.path(name))

    def _make_room(self, incoming: int, keep: set[str]) -> None:
        kept = []
        for path in self.folder.glob("_ray_pkg_*.zip"):
            try:
                info = path.stat()
            except FileNotFoundError:
                continue
            kept.append((info.st_mtime, info.st_size, path))
        total = sum(size for _, size, _ in kept) + incoming
        for _, size, path in sorted(kept, key=lambda k: k[0]):
            if total <= self.max_stored_bytes:
                break
            if path.name not in keep:
                path.unlink(missing_ok=True)
                total -= size
        if total > self.max_stored_bytes:
            raise PayloadTooLargeError(
                f"the cluster keeps at most {self.max_stored_bytes} bytes of packages and the ones "
                f"stored are in use by live jobs; wait for them to end or delete ended jobs")
