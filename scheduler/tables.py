"""What the tables of the cluster model share: the change log they all mark, and the read-only
mapping of its records that each table is.

:class:`~podium.scheduler.state.ClusterModel` composes four tables (nodes, placement groups,
workers, sessions), each an object with its own records and indexes. They share no state but
the :class:`ChangeLog` they are each given: what changed since the store last wrote, and the
version waiters compare.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from typing import TypeVar

from podium.scheduler.records import Dirty

__all__ = ["ChangeLog", "RecordTable"]

R = TypeVar("R")


class ChangeLog:
    """The ids of the records changed since the last :meth:`take`, and a version counter."""

    def __init__(self) -> None:
        self._dirty = Dirty()
        #: Bumped by every mutation; waiters compare it to know something changed.
        self.version = 0

    def touch(self, *, nodes: Iterable[str] = (), groups: Iterable[str] = (),
              workers: Iterable[str] = (), sessions: Iterable[str] = (), bump: bool = True) -> None:
        """Mark records changed; ``bump`` False leaves the version alone (a renewal that no
        waiter waits for)."""
        dirty = self._dirty
        dirty.nodes.update(dict.fromkeys(nodes))
        dirty.groups.update(dict.fromkeys(groups))
        dirty.workers.update(dict.fromkeys(workers))
        dirty.sessions.update(dict.fromkeys(sessions))
        if bump:
            self.version += 1

    def bump(self) -> None:
        """Count a change that marks no record (a restore)."""
        self.version += 1

    def pending(self) -> bool:
        """True when some record changed since the last :meth:`take`."""
        return bool(self._dirty)

    def take(self) -> Dirty:
        """The records changed since the last call (and forget them)."""
        dirty, self._dirty = self._dirty, Dirty()
        return dirty


class RecordTable(Mapping[str, R]):
    """A table's records by id, read-only: the table's own methods change them.

    The lookups go straight to the dict (a Mapping's generic ones would go through
    ``__getitem__`` once per record: /v1/placement reads every record of a large cluster).
    """

    def __init__(self) -> None:
        self._records: dict[str, R] = {}

    def __getitem__(self, key: str) -> R:
        return self._records[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def keys(self) -> KeysView[str]:
        """The ids, in insertion order."""
        return self._records.keys()

    def values(self) -> ValuesView[R]:
        """The records, in insertion order."""
        return self._records.values()

    def items(self) -> ItemsView[str, R]:
        """(id, record) pairs, in insertion order."""
        return self._records.items()
