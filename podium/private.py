"""Files and directories only their owner can read, whatever the umask.

The scheduler's state file holds worker environments (tokens, API keys) and a
worker's logs hold what its code prints, so Podium creates them 0600 in
directories it creates 0700 (issue #14). A mode given to ``open``/``mkdir`` is
masked by the umask, hence the explicit chmod after each.

A folder the user gives Podium (``init(log_dir=)``, ``podium node --log-dir``, ``podium up
--dir``) was not made by Podium: :func:`given_dir` refuses one that another local user could
plant a file, socket or symlink in (issue #48). Files are opened ``O_NOFOLLOW`` (a symlink
is never written through), temporary files are created ``O_EXCL`` under unpredictable
names, and a port file is read only when it is a regular file of this user written by the
process Podium started (:func:`read_port_file`).
"""

from __future__ import annotations

import errno
import grp
import json
import os
import pathlib
import pwd
import secrets
import stat

from podium.errors import PermissionDeniedError

__all__ = ["PRIVATE_FILE", "PRIVATE_DIR", "given_dir", "private_dir", "private_file", "open_private",
           "read_port_file", "write_private_atomic"]

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
    """Make an existing file of ours 0600 (one of another user, or a symlink, is left alone:
    a chmod would go through the link to whatever it names)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # missing, or a symlink (ELOOP)
        return
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
            os.fchmod(fd, PRIVATE_FILE)
    finally:
        os.close(fd)


def open_private(path: str | os.PathLike, mode: str = "ab"):
    """``open(path, mode)`` for writing, the file 0600 whether new or not."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    flags |= os.O_APPEND if mode.startswith("a") else os.O_TRUNC
    try:
        fd = os.open(path, flags, PRIVATE_FILE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionDeniedError(f"{path} is a symbolic link: Podium does not write through one "
                                        f"(remove it)") from None
        raise
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
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)
    try:
        os.fchmod(fd, PRIVATE_FILE)
        with os.fdopen(fd, "wb") as out:
            out.write(text.encode())
    except BaseException:
        os.unlink(tmp)
        raise
    os.replace(tmp, target)


def _unsafe(st: os.stat_result, given: bool) -> str:
    """Why another local user could create or replace entries in a folder of this ``st``
    (the given folder itself when ``given``, else a folder above it), or ''."""
    uid = os.getuid()
    if st.st_uid != uid and (given or st.st_uid != 0):
        return f"it belongs to uid {st.st_uid}, not to this user ({uid})"
    # Above the given folder a sticky bit (/tmp) keeps others from renaming what is not theirs.
    sticky = not given and st.st_mode & stat.S_ISVTX
    if st.st_mode & stat.S_IWOTH and not sticky:
        return "every user can write it"
    if st.st_mode & stat.S_IWGRP and not sticky:
        # A user-private group (umask 002 makes folders 0775) holds this user alone.
        try:
            group = grp.getgrgid(st.st_gid)
            me = pwd.getpwuid(uid).pw_name
        except KeyError:
            return f"group {st.st_gid} can write it"
        if st.st_gid != os.getgid() or set(group.gr_mem) - {me}:
            return f"group {group.gr_name} can write it"
    return ""


def given_dir(path: str | os.PathLike, what: str) -> pathlib.Path:
    """The folder ``path`` a user gave Podium (``what`` names the option), made 0700 if missing.

    PermissionDeniedError, naming the folder and the fix, when another local user could
    plant something in it: it belongs to another user or others can write it, or a folder
    above it is another user's or writable by others (a sticky folder such as /tmp is fine
    above it, not as it). ``PODIUM_SINGLE_USER=1`` skips the check, for a container whose
    every process runs as one uid (a Kubernetes emptyDir is world-writable by design)."""
    given = pathlib.Path(path).expanduser().absolute()
    if os.environ.get("PODIUM_SINGLE_USER") == "1":
        return private_dir(given).resolve()
    folder = given.resolve()
    for parent in sorted({*given.parents, *folder.parents}, key=lambda p: len(p.parts)):
        try:
            why = _unsafe(os.stat(parent), given=False)
        except FileNotFoundError:
            continue  # made below, 0700
        if why:
            raise PermissionDeniedError(
                f"{what} {given}: the folder above it, {parent}, is not safe ({why}), so another user "
                f"could replace or fill it. Give a folder under one only you can write (e.g. in your home)")
    private_dir(folder)
    why = _unsafe(os.stat(folder), given=True)
    if why:
        raise PermissionDeniedError(
            f"{what} {folder}: {why}, so another user could plant the sockets and files Podium keeps "
            f"there (its token, port files, logs). Give a folder only you can write: `chmod go-w {folder}` "
            f"if it is yours, or a new one (`mkdir -m 700 DIR`)")
    return folder


def read_port_file(path: str | os.PathLike, pid: int) -> dict | None:
    """The JSON of port file ``path`` once process ``pid`` (the child Podium started) wrote it
    whole; None until then. A file that is not a regular file of this user, or written by
    another process (a stale one of an earlier run, a planted one), is not read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:  # missing, or a symlink
        return None
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > 1 << 16:
            return None
        try:
            payload = json.loads(handle.read())
        except (ValueError, RecursionError):
            return None
    return payload if isinstance(payload, dict) and payload.get("pid") == pid else None
