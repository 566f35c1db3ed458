"""Results a worker keeps for later fetching (``hold_result`` calls), under a memory budget.

Each held value is stored with its encoded form (:class:`podium.codec.Encoded`,
whose buffers are the tensors' own memory, so holding both costs no copy) and
its encoded size. The sum of sizes may not exceed the budget
(``PODIUM_HOLD_BUDGET_BYTES``, default a quarter of the machine's RAM): a result
that would exceed it is refused with ResourceExhaustedError rather than letting
the worker run out of memory later. Release frees the entries.

An id is a capability: it ends in 64 random bits, so only whoever was handed the result's
ref (its owner, or whom the owner passed it to) can name it to fetch or release it; a
count and the worker's pid, both visible in ``/v1/workers``, no longer suffice (issue #48).
A release names at most :data:`~podium.limits.MAX_REPEATED` ids, like every repeated field.

Borrowers: another process that received a ref to a held value and keeps it (Ray's borrower)
counts one borrow on it (``ReleaseRequest.borrow``) until its last copy is gone
(``unborrow``). A value its owner released while borrowed stays until the last borrow is
given back, so a ref keeps its value alive in whichever process holds it, for as long as the
owner runs. Borrows are counted per borrower (the address its process answers on), so that
those of a borrower that died are given back for it (:meth:`HeldStore.borrower_gone`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import threading
from collections.abc import Mapping
from typing import Any

from podium.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from podium.limits import MAX_REPEATED, check_count

__all__ = ["HeldObject", "HeldStore", "default_budget", "MAX_BORROWERS"]

#: The most processes that may borrow one held value at once.
MAX_BORROWERS = 4096


def default_budget(env: Mapping[str, str] | None = None) -> int:
    """The hold budget in bytes: ``PODIUM_HOLD_BUDGET_BYTES`` or 25% of physical RAM."""
    env = os.environ if env is None else env
    text = env.get("PODIUM_HOLD_BUDGET_BYTES")
    if text:
        try:
            value = int(text)
        except ValueError as exc:
            raise InvalidArgumentError(f"PODIUM_HOLD_BUDGET_BYTES must be an integer, got {text!r}") from exc
        if value < 0:
            raise InvalidArgumentError(f"PODIUM_HOLD_BUDGET_BYTES must be >= 0, got {value}")
        return value
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


@dataclasses.dataclass
class HeldObject:
    """One held result."""

    object_id: str
    value: Any
    #: The encoded form (podium.codec.Encoded), reused for whole-object fetches.
    encoded: Any
    size_bytes: int
    rows: int
    #: The refs inside the value (a ``put`` value's): kept, and so their values, for as long
    #: as this value is held, as Ray keeps the refs an object contains.
    contains: list | None = None


class HeldStore:
    """Held results keyed by object id, with a byte budget. Thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._objects: dict[str, HeldObject] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._prefix = f"o-{os.getpid():x}-"
        #: Borrows of held values: by id, how many each borrower holds (only values other
        #: processes keep have one).
        self._borrows: dict[str, dict[str, int]] = {}
        #: The ids each borrower borrows (to give them back when it dies).
        self._lent: dict[str, set[str]] = {}
        #: Borrowed values their owner released: dropped when the last borrow goes.
        self._orphans: set[str] = set()

    @property
    def used_bytes(self) -> int:
        """Bytes held now."""
        return self._used

    def __len__(self) -> int:
        return len(self._objects)

    def _check_room(self, size_bytes: int) -> None:
        if self._used + size_bytes > self.budget_bytes:
            raise ResourceExhaustedError(
                f"hold budget exceeded: holding a result of {size_bytes} bytes would exceed "
                f"the budget of {self.budget_bytes} bytes (PODIUM_HOLD_BUDGET_BYTES); "
                f"{len(self._objects)} results of {self._used} bytes are held. "
                f"Fetch and release earlier results, or raise the budget",
                details={"budget_bytes": str(self.budget_bytes), "size_bytes": str(size_bytes),
                         "held_bytes": str(self._used), "held_count": str(len(self._objects))})

    def check_room(self, size_bytes: int) -> None:
        """ResourceExhaustedError now if ``size_bytes`` more would exceed the budget
        (lets a caller refuse before copying a large result)."""
        with self._lock:
            self._check_room(size_bytes)

    def put(self, value: Any, encoded: Any, size_bytes: int, rows: int) -> HeldObject:
        """Hold ``value``; ResourceExhaustedError when it would exceed the budget."""
        with self._lock:
            self._check_room(size_bytes)
            held = HeldObject(f"{self._prefix}{next(self._ids)}-{secrets.token_hex(8)}", value, encoded, size_bytes,
                              rows)
            self._objects[held.object_id] = held
            self._used += size_bytes
            return held

    def __contains__(self, object_id: object) -> bool:
        """Whether ``object_id`` is held here now."""
        return object_id in self._objects

    def get(self, object_id: str) -> HeldObject:
        """The held object (NotFoundError naming the id when it is unknown or released)."""
        held = self._objects.get(object_id)
        if held is None:
            raise NotFoundError(f"no held result {object_id!r} in this worker (never held here, "
                                f"or already released)", details={"object_id": object_id})
        return held

    def release(self, object_ids) -> int:
        """Drop the given ids (a borrowed one once its last borrow is given back); returns
        how many were held. Unknown ids are ignored; InvalidArgumentError for more than
        :data:`~podium.limits.MAX_REPEATED` ids."""
        if not object_ids:  # most call headers release nothing (CallHeader.release)
            return 0
        check_count(len(object_ids), MAX_REPEATED, "release: object ids")
        released = 0
        with self._lock:
            borrows = self._borrows
            for object_id in object_ids:
                if borrows and borrows.get(object_id):
                    if object_id in self._objects:
                        self._orphans.add(object_id)
                        released += 1
                    continue
                held = self._objects.pop(object_id, None)
                if held is not None:
                    self._used -= held.size_bytes
                    released += 1
        return released

    def borrow(self, object_ids, borrower: str = "") -> int:
        """Count one borrow by ``borrower`` (the address it answers on) of each held id
        (unknown ones are ignored: already lost); how many were counted."""
        return self._count(object_ids, 1, borrower)

    def unborrow(self, object_ids, borrower: str = "") -> int:
        """Give back one borrow by ``borrower`` of each id; a value its owner released goes
        with its last borrow. How many values were dropped."""
        return self._count(object_ids, -1, borrower)

    def borrowers(self) -> list[str]:
        """The borrowers that hold a borrow here now (the owner watches them: a dead one's
        borrows are given back for it, :meth:`borrower_gone`)."""
        with self._lock:
            return [name for name, ids in self._lent.items() if ids]

    def borrower_gone(self, borrower: str) -> int:
        """``borrower``'s process ended: give back all its borrows; how many values dropped."""
        with self._lock:
            ids = self._lent.pop(borrower, set())
            dropped = 0
            for object_id in ids:
                counts = self._borrows.get(object_id)
                if counts is not None:
                    counts.pop(borrower, None)
                    dropped += self._drop_if_orphan(object_id)
            return dropped

    def borrow_count(self, object_id: str) -> int:
        """How many borrows of ``object_id`` are counted here now."""
        with self._lock:
            return sum(self._borrows.get(object_id, {}).values())

    def kept_for_borrowers(self, object_id: str) -> bool:
        """Whether ``object_id`` is held only for its borrowers (its owner released it)."""
        return object_id in self._orphans

    def _count(self, object_ids, delta: int, borrower: str) -> int:
        # Each borrower sends its borrows and their returns in order (podium.borrows), so a
        # return with no borrow counted is one of a borrower already taken for gone: ignored.
        dropped = 0
        with self._lock:
            for object_id in object_ids:
                if object_id not in self._objects:
                    continue
                if delta < 0 and borrower not in self._borrows.get(object_id, {}):
                    continue
                counts = self._borrows.setdefault(object_id, {})
                if borrower not in counts and len(counts) >= MAX_BORROWERS:
                    raise ResourceExhaustedError(
                        f"held value {object_id} has {len(counts)} borrowers already (the most: {MAX_BORROWERS})")
                count = counts.get(borrower, 0) + delta
                if count:
                    counts[borrower] = count
                    self._lent.setdefault(borrower, set()).add(object_id)
                    continue
                counts.pop(borrower, None)
                lent = self._lent.get(borrower)
                if lent is not None:
                    lent.discard(object_id)
                    if not lent:
                        del self._lent[borrower]
                dropped += self._drop_if_orphan(object_id)
        return dropped

    def _drop_if_orphan(self, object_id: str) -> int:
        # (Under the lock.) A value nobody borrows any more goes if its owner released it.
        if self._borrows.get(object_id):
            return 0
        self._borrows.pop(object_id, None)
        if object_id not in self._orphans:
            return 0
        self._orphans.discard(object_id)
        held = self._objects.pop(object_id)
        self._used -= held.size_bytes
        return 1

    def clear(self) -> None:
        """Drop everything."""
        with self._lock:
            self._objects.clear()
            self._borrows.clear()
            self._lent.clear()
            self._orphans.clear()
            self._used = 0
