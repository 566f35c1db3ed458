"""Lifetime as in Ray: when nothing refers to a WorkerGroup (nor to any view spawned from it,
nor to an actor handle) any more, its non-detached workers stop and their slots are freed.

A group and each of its views share one :class:`Lifetime` token (views are shallow copies).
When the last of them is garbage the token is too, and a ``weakref.finalize`` on it queues
the removal onto the runtime's loop: the finalizer itself does no I/O (it may run in any
thread, inside any allocation), the loop then closes the connections, asks the scheduler to
remove the workers and releases the placement groups nobody else uses, as ``shutdown()``
does. Groups of detached workers, attached groups and views arm nothing. Note that a group
is part of reference cycles (its bound methods refer to it), so, as in CPython generally,
it goes at the next cyclic collection (``gc.collect()``), not always at ``del``.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from podium.controller.session.contract import Session

__all__ = ["Lifetime", "arm", "rearm", "remove_later"]

log = logging.getLogger("podium.controller")


class Lifetime:
    """The token a group and its views share; its finalizer stops the group's workers."""

    __slots__ = ("finalizer", "__weakref__")

    def __init__(self) -> None:
        self.finalizer: weakref.finalize | None = None

    def disarm(self) -> None:
        """The workers are gone another way (``shutdown()``): do nothing when collected."""
        if self.finalizer is not None:
            self.finalizer.detach()


def remove_later(rt: Session, worker_ids: list[str], clients: list, user: int, pg_ids: list[str],
                 owned_pg_ids: Sequence[str] = ()) -> None:
    """Queue the removal of workers (and of placement groups) onto ``rt``'s loop; returns at
    once and does no I/O (safe in a finalizer)."""
    if rt.closed:
        return

    async def remove() -> None:
        rt.deathwatch.forget(worker_ids)
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()
        with contextlib.suppress(Exception):
            await rt.scheduler.remove_workers(worker_ids)
        if pg_ids:
            await rt.release_pgs(user, pg_ids)
        for pg_id in owned_pg_ids:
            with contextlib.suppress(Exception):
                await rt.scheduler.remove_placement_group(pg_id)
        rt.stats["collected_workers"] = rt.stats.get("collected_workers", 0) + len(worker_ids)
        log.debug("removed %d workers whose last handle was dropped", len(worker_ids))

    def start() -> None:
        if not rt.closed:
            rt.loop.create_task(remove())

    with contextlib.suppress(RuntimeError):  # the loop is closed: the runtime removed them
        rt.loop.call_soon_threadsafe(start)


def arm(rt: Session, workers: Sequence[Any], user: int, pg_ids: Sequence[str],
        owned_pg_ids: Sequence[str] = ()) -> Lifetime:
    """A token for ``workers`` (WorkerHandles of ``rt``'s group ``user``, which uses the
    placement groups ``pg_ids``): once it is garbage, they are removed."""
    return rearm(Lifetime(), rt, workers, user, pg_ids, owned_pg_ids)


def rearm(token: Lifetime, rt: Session, workers: Sequence[Any], user: int, pg_ids: Sequence[str],
          owned_pg_ids: Sequence[str] = ()) -> Lifetime:
    """Point ``token`` (and so the group and every view sharing it) at ``workers`` now: a
    group whose ranks or standbys changed (``replace_rank``)."""
    token.disarm()
    token.finalizer = weakref.finalize(
        token, remove_later, rt, [w.worker_id for w in workers],
        [w.client for w in workers if w.client is not None], user, list(pg_ids), list(owned_pg_ids))
    token.finalizer.atexit = False  # at exit the runtime's shutdown removes everything
    return token
