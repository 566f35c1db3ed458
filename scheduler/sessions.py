"""The session table of the cluster model: controller sessions and their leases.

What dies with a session (its groups and workers) is the cluster model's to decide
(:meth:`~podium.scheduler.state.ClusterModel.close_session`); this table holds the sessions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from podium import errors
from podium.limits import MAX_SESSION_LEASE_SECONDS, check_seconds
from podium.scheduler.records import Session
from podium.scheduler.tables import ChangeLog, RecordTable

__all__ = ["SessionTable"]


class SessionTable(RecordTable[Session]):
    """The open controller sessions by id.

    ``changes`` is marked by every change; ``new_id`` makes session ids;
    ``default_lease`` is the lease of a session that asks for 0 seconds.
    """

    def __init__(self, changes: ChangeLog, *, new_id: Callable[[str], str],
                 default_lease: float = 30.0) -> None:
        super().__init__()
        self._changes = changes
        self._new_id = new_id
        #: Lease of a session that asks for 0 seconds.
        self.default_lease = default_lease

    def lookup(self, session_id: str) -> Session:
        """An open session, or NotFoundError."""
        found = self._records.get(session_id)
        if found is None:
            raise errors.NotFoundError(f"unknown or expired session {session_id!r}")
        return found

    def open(self, description: str, lease_seconds: float, now: float) -> Session:
        """Open a controller session; lease 0 means the default (at most an hour)."""
        lease = (check_seconds(lease_seconds, "lease_seconds", MAX_SESSION_LEASE_SECONDS)
                 or self.default_lease)
        session = Session(id=self._new_id("s"), description=description, lease_seconds=lease,
                          renewed_at=now, created_at=now)
        self._records[session.id] = session
        self._changes.touch(sessions=[session.id])
        return session

    def keep_alive(self, session_id: str, now: float) -> bool:
        """Renew a session; False when it is unknown or already expired."""
        session = self._records.get(session_id)
        if session is None:
            return False
        session.renewed_at = now
        # Saved, but no waiter waits for a renewal.
        self._changes.touch(sessions=[session_id], bump=False)
        return True

    def end(self, session: Session) -> None:
        """Forget a closed or expired session."""
        del self._records[session.id]
        self._changes.touch(sessions=[session.id])

    def expired(self, now: float, since: float) -> list[Session]:
        """The sessions whose lease ran out at ``now``, silence counted from ``since`` at the
        earliest."""
        return [s for s in self._records.values() if s.expired(now, since=since)]

    def restore(self, sessions: Iterable[Session], now: float) -> None:
        """Load persisted sessions; their leases restart at ``now``."""
        for session in sessions:
            session.renewed_at = now
            self._records[session.id] = session
