"""``ray.scripts.scripts.memory_summary``: the text ``ray memory --stats-only`` prints, which
NeMo-RL's driver memory tracker logs after each stage.

Ray sums its plasma stores across nodes. Podium has no shared object store: each process holds
the values it puts or returns, and serves them to whoever resolves their refs. So the summary is
this process's own store (the controller's for a driver, the worker's in a worker): how many
values it holds, their bytes, and its hold budget. The per-object table that Ray prints without
``stats_only`` is refused: ``podium status`` shows each worker's held values.
"""

from __future__ import annotations

from typing import Any

from podium.errors import InvalidArgumentError, NotProvidedError

__all__ = ["memory_summary"]

#: Ray's ``units`` and their sizes in bytes.
UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
#: Ray's ``group_by`` and ``sort_by`` values (they order the per-object table, which is refused).
GROUP_BY = ("NODE_ADDRESS", "STACK_TRACE")
SORT_BY = ("PID", "OBJECT_SIZE", "REFERENCE_TYPE")


def memory_summary(address: str | None = None, group_by: str = "NODE_ADDRESS", sort_by: str = "OBJECT_SIZE",
                   units: str = "B", line_wrap: bool = True, stats_only: bool = False,
                   num_entries: int | None = None) -> str:
    """The held values of this process's object store, as text (``stats_only=True``).
    ``address`` must be None or "auto" (this process's cluster); ``group_by``, ``sort_by``,
    ``line_wrap`` and ``num_entries`` shape Ray's per-object table and are checked, not used.
    ``stats_only=False`` raises :class:`~podium.errors.NotProvidedError` naming ``podium status``."""
    if address not in (None, "auto"):
        raise InvalidArgumentError(f"memory_summary(address={address!r}): only this process's cluster "
                                   "(address=None or 'auto') is summarised on Podium")
    if units not in UNITS:
        raise InvalidArgumentError(f"memory_summary(units={units!r}): one of {sorted(UNITS)}")
    if group_by not in GROUP_BY or sort_by not in SORT_BY:
        raise InvalidArgumentError(f"memory_summary(group_by={group_by!r}, sort_by={sort_by!r}): group_by is one "
                                   f"of {GROUP_BY}, sort_by one of {SORT_BY}")
    if num_entries is not None and (not isinstance(num_entries, int) or num_entries < 0):
        raise InvalidArgumentError(f"memory_summary(num_entries={num_entries!r}): a count >= 0 or None")
    if not stats_only:
        raise NotProvidedError("memory_summary(stats_only=False), Ray's table of every object ref, is not provided "
                               "by Podium's ray stand-in (Podium has no shared object store); on Podium use: "
                               "memory_summary(stats_only=True) for this process's held values, `podium status` "
                               "for each worker's")
    count, used, budget = _held()
    scale = UNITS[units]
    full = 100.0 * used / budget if budget else 0.0
    return ("--- Object store stats of this process (Podium has no shared object store: each process holds "
            "the values it puts or returns) ---\n"
            f"Held values: {count} objects, {used / scale:.2f} {units}, {full:.1f}% of this process's hold budget "
            f"({budget / scale:.2f} {units})\n")


def _held() -> tuple[int, int, int]:
    """(values, bytes, budget) of this process's store: the worker's in a worker, else the
    controller's (zeros before its first ``put``)."""
    from podium.controller.session import runtime
    from podium.worker.host import object_store

    store: Any = object_store()
    if store is None and runtime.is_initialized():
        store = runtime.get_runtime().objects.store
    if store is None:
        from podium.worker.host.heldstore import default_budget

        return 0, 0, default_budget()
    used, budget = store.held_bytes
    return store.held_count, used, budget
