"""Opening the scheduler's SQLite state file safely: created whole, private, checked on start.

A state file is created under a temporary name and renamed into place once its
schema is written, so a crash during creation never leaves an empty file behind;
an empty, truncated, corrupt or foreign file is therefore never Podium's own, and
the scheduler refuses to start on one (:class:`StateFileError`, naming the file
and the two ways out) instead of starting empty and stopping every worker the
file knew (issue #14). ``--fresh-state`` moves such a file aside, keeping it.
The file, its WAL and its lock are 0600 in a 0700 directory (they hold worker
environments, which may carry tokens).
"""

from __future__ import annotations

import os
import sqlite3
import time

from podium.errors import FailedPreconditionError, InvalidArgumentError
from podium.private import PRIVATE_FILE, private_dir, private_file

__all__ = ["StateFileError", "TABLES", "JOBS_TABLE", "open_state_db", "set_aside", "refuse_directory"]

#: Every table of a Podium state file (id, first-insert seq, serialized record).
TABLES = ("nodes", "placement_groups", "workers", "sessions")
#: Submitted jobs (podium.scheduler.jobs): JSON records, added to files of older versions.
JOBS_TABLE = "jobs"
#: Marks a file as Podium's (files of older versions have the tables but no mark).
FORMAT = "podium-scheduler-state-1"


class StateFileError(FailedPreconditionError):
    """The state file exists but cannot be used; the message names it and the fix."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(
            f"state file {path} {problem}. It was left as it is. Start the scheduler with "
            f"--state pointing to another file, or with --fresh-state to move this one aside "
            f"(to {path}.bad-<time>) and start with an empty state.")
        self.path = path


def refuse_directory(path: str) -> None:
    """Raise InvalidArgumentError when ``path`` is a directory (``--state DIR``): sqlite3's
    own answer is a bare OperationalError, and ``--fresh-state`` must not move a folder aside."""
    if os.path.isdir(path):
        raise InvalidArgumentError(
            f"--state {path} is a directory; it names the state file itself, "
            f"e.g. --state {os.path.join(path, 'scheduler.db')}")


def set_aside(path: str) -> str:
    """Rename ``path`` (and its -wal/-shm) to ``path.bad-<UTC time>``; returns the new name."""
    target = f"{path}.bad-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.replace(path + suffix, target + suffix)
    return target


def _schema(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    for table in (*TABLES, JOBS_TABLE):
        db.execute(f"CREATE TABLE IF NOT EXISTS {table} "
                   "(id TEXT PRIMARY KEY, seq INTEGER NOT NULL, data BLOB NOT NULL)")
    db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('format', ?)", (FORMAT,))


def _create(path: str) -> None:
    tmp = f"{path}.new-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    os.fchmod(fd, PRIVATE_FILE)
    os.close(fd)
    db = sqlite3.connect(tmp, isolation_level=None)
    try:
        _schema(db)
    finally:
        db.close()  # checkpoints the WAL into the file and removes it
    os.replace(tmp, path)


def _check(db: sqlite3.Connection, path: str) -> None:
    try:
        names = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        problem = db.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        raise StateFileError(path, f"is not a readable SQLite database ({exc})") from None
    if problem != "ok":
        raise StateFileError(path, f"is damaged (SQLite quick_check: {problem})")
    missing = [t for t in TABLES if t not in names]
    if missing:
        raise StateFileError(path, f"is not a Podium state file (no table {', '.join(missing)})")
    if "meta" in names:
        row = db.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
        if row is None or row[0] != FORMAT:
            raise StateFileError(path, f"has format {row[0] if row else None!r}, not {FORMAT!r}")


def open_state_db(path: str) -> sqlite3.Connection:
    """Open (creating it whole and private when missing) and check the state database.

    Raises :class:`StateFileError` for a file that exists but is empty, not SQLite,
    damaged, or not Podium's. ``":memory:"`` is a fresh in-memory database.
    """
    if path == ":memory:":
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        _schema(db)
        return db
    refuse_directory(path)
    private_dir(os.path.dirname(os.path.abspath(path)))
    if not os.path.exists(path):
        _create(path)
    elif os.path.getsize(path) == 0:
        raise StateFileError(path, "is empty (0 bytes; Podium never writes an empty state file, "
                                   "so it was truncated)")
    private_file(path)
    # The service uses it from its one event loop thread only.
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        _check(db, path)
        _schema(db)  # adds the meta table to a file of an older version
    except sqlite3.DatabaseError as exc:
        db.close()
        raise StateFileError(path, f"cannot be written ({exc})") from None
    except BaseException:
        db.close()
        raise
    for suffix in ("-wal", "-shm"):  # SQLite copies the file's mode; make sure whatever the umask
        private_file(path + suffix)
    return db
