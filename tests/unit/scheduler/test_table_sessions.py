"""SessionTable alone: open, renew, end and expiry of controller sessions, and what each marks."""

import itertools

import pytest

from podium import errors
from podium.scheduler.sessions import SessionTable
from podium.scheduler.tables import ChangeLog


def _table(default_lease=30.0):
    changes = ChangeLog()
    counter = itertools.count()
    return SessionTable(changes, new_id=lambda prefix: f"{prefix}-{next(counter)}",
                        default_lease=default_lease), changes


def test_open_uses_the_default_lease_for_zero_and_marks_the_session():
    table, changes = _table(default_lease=12)
    session = table.open("trainer", 0, now=5)
    assert (session.id, session.lease_seconds, session.renewed_at) == ("s-0", 12, 5)
    assert table.lookup("s-0") is session and "s-0" in table and len(table) == 1
    assert changes.version == 1 and list(changes.take().sessions) == ["s-0"]
    assert table.open("other", 3, now=5).lease_seconds == 3


def test_a_bad_lease_changes_nothing():
    table, changes = _table()
    with pytest.raises(errors.InvalidArgumentError, match="lease_seconds"):
        table.open("x", -1, now=0)
    assert not table and not changes.pending() and changes.version == 0


def test_keep_alive_renews_and_is_saved_without_waking_waiters():
    table, changes = _table()
    session = table.open("x", 10, now=0)
    changes.take()
    assert table.keep_alive(session.id, now=8)
    assert session.renewed_at == 8
    assert list(changes.take().sessions) == [session.id] and changes.version == 1
    assert not table.keep_alive("s-unknown", now=8)


def test_expired_counts_silence_from_the_later_of_renewal_and_since():
    table, _ = _table()
    quiet = table.open("quiet", 10, now=0)
    table.open("busy", 10, now=0)
    table.keep_alive("s-1", now=9)
    assert table.expired(now=15, since=0) == [quiet]
    assert table.expired(now=15, since=6) == []  # a stall until 6 excuses the silence before it


def test_end_forgets_and_marks_and_lookup_then_fails():
    table, changes = _table()
    session = table.open("x", 10, now=0)
    changes.take()
    table.end(session)
    assert session.id not in table and list(changes.take().sessions) == [session.id]
    with pytest.raises(errors.NotFoundError, match="unknown or expired session"):
        table.lookup(session.id)


def test_restore_restarts_leases():
    old, _ = _table()
    session = old.open("x", 10, now=0)
    table, changes = _table()
    table.restore([session], now=100)
    assert table.lookup(session.id).renewed_at == 100 and not table.expired(105, since=0)
    assert not changes.pending()  # loading is not a change to write back
