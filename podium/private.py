"""Files and directories only their owner can read, whatever the umask.

The scheduler's state file holds worker environments (tokens, API keys) and a
worker's logs hold what its code prints, so Podium creates them 0600 in
directories it creates 0700 (issue #14). A mode given to ``open``/``mkdir`` is
masked by the umask, hence the explicit chmod after each.
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["PRIVATE_FILE", "PRIVATE_DIR", "private_dir", "private_file", "open_private",
           "write_private_atomic"]

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def private_dir(path: str | os.PathLike) -> pathlib.Path:
    """Create ``path`` and its missing parents 0700; an existing ``~/.podium`` is made 0700 too.

    Directories that already exist (``/tmp``, a user's project folder) keep their
    mode, except Podium's own home folder, which older versions created 0755.
    """
    path = pathlib.Path(path).expanduser()
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=PRIVATE_DIR)
        except FileExistsError:  # created meanwhile by another process
            continue
        os.chmod(folder, PRIVATE_DIR)
    home = pathlib.Path.home() / ".podium"
    for folder in (path, *path.parents):
        if folder == home and folder.is_dir() and folder.stat().st_uid == os.getuid():
            os.chmod(folder, PRIVATE_DIR)
    return path


def private_file(path: str | os.PathLike) -> None:
    """Make an existing file of ours 0600 (one of another user is left alone)."""
    try:
        if os.stat(path).st_uid == os.getuid():
            os.chmod(path, PRIVATE_FILE)
    except FileNotFoundError:
        pass


def open_private(path: str | os.PathLike, mode: str = "ab"):
    """``open(path, mode)`` for writing, the file 0600 whether new or not."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
    flags |= os.O_APPEND if mode.startswith("a") else os.O_TRUNC
    fd = os.open(path, flags, PRIVATE_FILE)
    try:
        os.fchmod(fd, PRIVATE_FILE)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def write_private_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` 0600 through a temporary file and a rename, so a reader
    polling for it sees it whole or not at all; its missing folders are created 0700."""
    target = pathlib.Path(path)
    private_dir(target.parent)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open_private(tmp, "wb") as out:
        out.write(text.encode())
    os.replace(tmp, target)
