"""Controller sessions of the cluster model: open, renew, close (and what dies with them).

Part of :class:`~podium.scheduler.state.ClusterModel` (a mixin over its shared dicts).
"""

from __future__ import annotations

from podium import errors
from podium.limits import MAX_SESSION_LEASE_SECONDS, check_seconds
from podium.scheduler.records import LIVE_WORKER_STATES, Effects, Session
from podium.v1 import common_pb2

__all__ = ["SessionsMixin"]


class SessionsMixin:
    """Session records of the cluster model (``self.sessions``)."""

    def session(self, session_id: str) -> Session:
        """An open session, or NotFoundError."""
        found = self.sessions.get(session_id)
        if found is None:
            raise errors.NotFoundError(f"unknown or expired session {session_id!r}")
        return found

    def open_session(self, description: str, lease_seconds: float, now: float) -> Session:
        """Open a controller session; lease 0 means the scheduler default (at most an hour)."""
        lease = (check_seconds(lease_seconds, "lease_seconds", MAX_SESSION_LEASE_SECONDS)
                 or self.default_session_lease)
        session = Session(id=self._new_id("s"), description=description, lease_seconds=lease,
                          renewed_at=now, created_at=now)
        self.sessions[session.id] = session
        self._touch(sessions=[session.id])
        return session

    def keep_alive(self, session_id: str, now: float) -> bool:
        """Renew a session; False when it is unknown or already expired."""
        session = self.sessions.get(session_id)
        if session is None:
            return False
        session.renewed_at = now
        self._dirty.sessions[session_id] = None
        return True

    def close_session(self, session_id: str, now: float) -> tuple[int, int, Effects]:
        """End a session: remove its non-detached groups and workers.

        Returns (groups removed, workers stopped, effects).
        """
        session = self.session(session_id)
        groups, workers, effects = self._close_session(session, f"session {session_id} closed", now)
        self._promote_pending()
        return groups, workers, effects

    def _close_session(self, session: Session, reason: str, now: float) -> tuple[int, int, Effects]:
        del self.sessions[session.id]
        self._touch(sessions=[session.id])
        effects = Effects()
        removed_groups = removed_workers = 0
        for group in list(self.groups.values()):
            if group.owner == session.id and not group.detached and group.state != common_pb2.PG_REMOVED:
                count, more = self._remove_group(group, reason, now)
                removed_groups += 1
                removed_workers += count
                effects.merge(more)
        for worker in self.workers.values():
            if (worker.owner == session.id and not worker.spec.detached
                    and worker.state in LIVE_WORKER_STATES):
                self._stop_worker(worker, reason, effects)
                removed_workers += 1
        return removed_groups, removed_workers, effects
