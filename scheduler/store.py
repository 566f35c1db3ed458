"""SQLite persistence of the scheduler state, so a restarted scheduler forgets nothing.

One table per record kind, each row the record's id and its serialized protobuf
(sessions, which have no message, as JSON): the schema never changes when the
messages grow a field. The service writes through after every mutating RPC, in
one transaction (:meth:`Store.save`); :meth:`Store.load_into` fills a fresh
:class:`ClusterModel` on start. WAL with ``synchronous=NORMAL``: a crash of the
scheduler process (SIGKILL) loses nothing that was committed; only a power loss
can lose the last transactions.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
from dataclasses import asdict

from google.protobuf.message import DecodeError

from podium.errors import FailedPreconditionError, PodiumError
from podium.private import open_private, private_dir
from podium.resources import validate_bundles
from podium.scheduler.state import ClusterModel, Dirty, Session
from podium.scheduler.statefile import JOBS_TABLE, StateFileError, open_state_db, refuse_directory, set_aside
from podium.v1 import common_pb2

__all__ = ["Store"]

_TABLES: dict[str, type[common_pb2.NodeStatus] | type[common_pb2.PlacementGroup]
              | type[common_pb2.WorkerInfo]] = {
    "nodes": common_pb2.NodeStatus,
    "placement_groups": common_pb2.PlacementGroup,
    "workers": common_pb2.WorkerInfo,
}


class Store:
    """The state file. ``":memory:"`` keeps nothing across restarts (tests, embedded use)."""

    def __init__(self, path: str, *, fresh: bool = False) -> None:
        """Open (or create) the state file; ``fresh`` first moves an existing one aside.

        An existing file that is empty, truncated, damaged, not Podium's or holds a
        record that does not decode raises :class:`~podium.scheduler.statefile.StateFileError`
        (see :mod:`podium.scheduler.statefile`), unless ``fresh``.
        """
        self.path = path
        self._lock = None
        #: Where ``fresh`` moved the previous state file ("" when it did not).
        self.set_aside = ""
        if path != ":memory:":
            path = os.path.expanduser(path)
            refuse_directory(path)  # before its lock file or --fresh-state touch anything
            private_dir(os.path.dirname(os.path.abspath(path)))
            # Two schedulers writing one state file would each believe they own every
            # GPU in it. The kernel drops the lock when the holder dies, even by SIGKILL.
            self._lock = open_private(path + ".lock", "ab")
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._lock.close()
                raise FailedPreconditionError(
                    f"state file {path} is in use by another scheduler") from None
            if fresh and os.path.exists(path):
                self.set_aside = set_aside(path)
        try:
            self._db = open_state_db(path)
            self._records = self._decode_all(path)
        except BaseException:
            if hasattr(self, "_db"):
                self._db.close()
            if self._lock is not None:
                self._lock.close()
            raise
        self._seq = 1 + max(self._db.execute(f"SELECT COALESCE(MAX(seq), 0) FROM {t}").fetchone()[0]
                            for t in (*_TABLES, "sessions", JOBS_TABLE))

    def _decode_all(self, path: str) -> dict[str, list]:
        """Every stored record, decoded and checked (StateFileError naming a bad row)."""
        loaded: dict[str, list] = {}
        try:
            for table in (*_TABLES, "sessions"):
                cls = _TABLES.get(table)
                loaded[table] = []
                for record_id, data in self._db.execute(f"SELECT id, data FROM {table} ORDER BY seq"):
                    try:
                        record = Session(**json.loads(data)) if cls is None else cls.FromString(data)
                        if isinstance(record, common_pb2.PlacementGroup):
                            validate_bundles([dict(b.resources) for b in record.bundles])
                    except (DecodeError, ValueError, TypeError, PodiumError) as exc:
                        raise StateFileError(path, f"has a bad {table} row {record_id!r} ({exc})") from None
                    loaded[table].append(record)
        except sqlite3.DatabaseError as exc:
            raise StateFileError(path, f"is damaged ({exc})") from None
        return loaded

    def load_into(self, model: ClusterModel, now: float) -> None:
        """Fill ``model`` with everything stored (leases restart at ``now``)."""
        loaded, self._records = self._records, {}
        model.restore(loaded["nodes"], loaded["placement_groups"], loaded["workers"],
                      loaded["sessions"], now)

    def save(self, model: ClusterModel, dirty: Dirty) -> None:
        """Write the records named in ``dirty`` (deleting those gone), in one transaction."""
        plan = (("nodes", dirty.nodes, model.nodes),
                ("placement_groups", dirty.groups, model.groups),
                ("workers", dirty.workers, model.workers))
        cur = self._db.cursor()
        cur.execute("BEGIN")
        try:
            for table, ids, records in plan:
                for record_id in ids:
                    record = records.get(record_id)
                    if record is None:
                        cur.execute(f"DELETE FROM {table} WHERE id = ?", (record_id,))
                    else:
                        self._put(cur, table, record_id, record.SerializeToString())
            for session_id in dirty.sessions:
                session = model.sessions.get(session_id)
                if session is None:
                    cur.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
                else:
                    self._put(cur, "sessions", session_id, json.dumps(asdict(session)).encode())
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise

    def _put(self, cur: sqlite3.Cursor, table: str, record_id: str, data: bytes) -> None:
        # seq keeps the first-insert order (creation order) across updates.
        cur.execute(f"INSERT INTO {table} (id, seq, data) VALUES (?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET data = excluded.data",
                    (record_id, self._seq, data))
        self._seq += 1

    def load_jobs(self) -> list[dict]:
        """Every stored job record (podium.scheduler.jobs), in submission order."""
        out = []
        for record_id, data in self._db.execute(f"SELECT id, data FROM {JOBS_TABLE} ORDER BY seq"):
            try:
                out.append(json.loads(data))
            except ValueError as exc:
                raise StateFileError(self.path, f"has a bad jobs row {record_id!r} ({exc})") from None
        return out

    def put_job(self, job_id: str, record: dict) -> None:
        """Write one job record (one statement: SQLite makes it a transaction)."""
        self._put(self._db.cursor(), JOBS_TABLE, job_id, json.dumps(record).encode())

    def delete_job(self, job_id: str) -> None:
        """Forget one job record."""
        self._db.execute(f"DELETE FROM {JOBS_TABLE} WHERE id = ?", (job_id,))

    def close(self) -> None:
        """Close the database and release the state file."""
        self._db.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None
