"""Actor restarts (Ray's ``max_restarts``), done by the actor's owner: the process that
created it, which holds the constructor's arguments.

When the owner's connection to the actor's worker breaks, :class:`Restarter` confirms the
death with the scheduler (the worker's exit record, which also frees its slot and its name),
starts a new worker under the same name, in the actor's own placement group (a fresh one on
any node that fits when that group is gone with its node) or in the bundle it was given, and
runs the constructor again with the same arguments. Calls made meanwhile wait behind the
restart (the group caller's gate) and go to the new worker; calls that were in flight are
handled by :mod:`.actorcalls` (``max_task_retries``). Each new worker's spec carries the
restart count (``podium status`` shows it; the scheduler counts restarts in
``podium_actor_restarts_total``). After ``max_restarts`` restarts, or when the constructor
fails on a restart, the actor is dead for good: its calls fail with ``ActorDiedError``
(WorkerDiedError) naming the count.

Where Podium differs from Ray: the owner restarts the actor, not a cluster service, so an
actor whose owner process is gone (a detached actor after its creator exited) is not
restarted; a worker on a node that is cut off (not closed) is found dead at its next call,
or by the death watch while calls are pending; and an actor that stops answering the liveness
pings while calls are pending (UnresponsiveError) is stopped and restarted (Ray leaves a hung
actor as it is).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

from podium.controller.remote.actorplace import construct, create_worker, remove, reserve
from podium.errors import FailedPreconditionError, NotFoundError, RemoteError, UnavailableError, WorkerDiedError

if TYPE_CHECKING:
    from podium.controller.remote.actoroptions import Options
    from podium.controller.session.contract import Session

__all__ = ["Restarter", "restarter_of", "died_for_good", "is_death"]

log = logging.getLogger("podium.controller")

#: How long a restart waits for the scheduler to record the old worker's end (its name and
#: slot are free then): a SIGKILLed worker's agent reports it at once; a lost node's workers
#: end when the node's lease runs out.
_EXIT_WAIT_SECONDS = 120.0

#: The restarters of the actors this process owns, by worker name (handles unpickled here
#: find them too).
_by_name: "weakref.WeakValueDictionary[str, Restarter]" = weakref.WeakValueDictionary()


def restarter_of(wname: str) -> "Restarter | None":
    """The restarter of the actor named ``wname`` if this process owns it."""
    return _by_name.get(wname)


def died_for_good(wname: str, restarts: int, max_restarts: int, cause: Any) -> WorkerDiedError:
    """Ray's ActorDiedError for an actor that will not come back, naming its restart count."""
    limit = "no limit" if max_restarts < 0 else f"max_restarts={max_restarts}"
    return WorkerDiedError(f"actor {wname} died and was restarted {restarts} time{'s' if restarts != 1 else ''} "
                           f"({limit}): it is dead for good; last cause: {cause}")


class Restarter:
    """Restarts one actor this process owns (see the module docstring).

    ``group`` is the actor's one-worker group, ``make_payload()`` encodes its constructor's
    call anew (a payload is sent once), ``own_pg`` the placement group made for it ("" when it
    sits in the given bundle ``bundle`` of ``pg_id``)."""

    def __init__(self, rt: Session, group: Any, opts: Options, wname: str, make_payload: Any, own_pg: str,
                 pg_id: str, bundle: int) -> None:
        self._rt = rt
        # Weak: the group (with its lifetime token) must be free to go with its last handle.
        self._group_ref = weakref.ref(group)
        self._opts = opts
        self.wname = wname
        self._make_payload = make_payload
        self.own_pg = own_pg
        self._pg_id = pg_id
        self._bundle = bundle
        #: Restarts so far.
        self.restarts = 0
        #: The restart under way (or the last one), a concurrent future: None before any.
        self.current: concurrent.futures.Future | None = None
        #: The id of the worker the actor runs in now (the newest incarnation).
        self.worker_id = group.workers[0].worker_id
        #: The error every call gets once the actor is dead for good, else None.
        self.dead: WorkerDiedError | None = None
        #: Set when the actor is stopped on purpose (kill, shutdown): no restart then.
        self.stopped = False
        #: Set by ``kill(no_restart=False)`` here: the stop it asks for is followed by a restart.
        self.expect_kill = False
        _by_name[wname] = self

    @property
    def _group(self) -> Any:
        """The actor's group, or None once it is garbage."""
        return self._group_ref()

    @property
    def max_restarts(self) -> int:
        """The actor's max_restarts (-1: no limit)."""
        return self._opts.max_restarts

    def watch(self) -> None:
        """Hear of the current worker's death (on the runtime's loop or before any call)."""
        group = self._group
        if group is None:
            return
        worker = group.workers[0]
        # The client takes all its pending calls when its calls break (WorkerClient._fail_all),
        # after recording why (client.broken): the one moment every break passes through.
        worker.client._pending.on_take_all = lambda w=worker: self._on_broken(w, w.client.broken)

    def stop(self) -> None:
        """The actor is being stopped on purpose: no restart from now on."""
        self.stopped = True
        if _by_name.get(self.wname) is self:
            del _by_name[self.wname]
        with contextlib.suppress(Exception):
            self._group.workers[0].client._pending.on_take_all = None  # (AttributeError once it is gone)

    def will_restart(self) -> bool:
        """Whether a death now would be followed by a restart."""
        return not self.stopped and self.dead is None and not self._rt.closed and (
            self.max_restarts < 0 or self.restarts < self.max_restarts)

    def _on_broken(self, worker: Any, exc: BaseException) -> None:
        # On the loop, before the pending calls fail: calls made from now on queue behind
        # the restart (the group caller's gate), and the in-flight ones find it under way.
        worker.client._pending.on_take_all = None  # once per worker
        group = self._group
        if (self.stopped or self._rt.closed or group is None or group._calls.closed
                or worker.worker_id != self.worker_id):
            return
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        self.current = future
        calls = group._calls
        with calls._gate_lock:
            calls.gate = future
        asyncio.get_running_loop().create_task(self._restart(group, worker, exc, future))

    async def wait_replaced(self, dead_worker_id: str) -> None:
        """Return once the actor runs in a worker other than ``dead_worker_id`` and its
        constructor finished; raise its error when it is dead for good."""
        while True:
            if self.dead is not None:
                raise self.dead
            future = self.current
            if self.worker_id != dead_worker_id and (future is None or future.done()):
                return
            if future is None or future.done():
                if self.stopped or self._rt.closed:
                    raise died_for_good(self.wname, self.restarts, self.max_restarts, "the actor was stopped")
                await asyncio.sleep(0.02)  # the death is known, its restart not started yet
                continue
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(future)

    async def _restart(self, group: Any, worker: Any, cause: BaseException,
                       future: concurrent.futures.Future) -> None:
        rt = self._rt
        started = time.monotonic()
        try:
            cause = await group._calls.convert(worker, cause, "its life")
            if not self.will_restart():
                raise died_for_good(self.wname, self.restarts, self.max_restarts, cause)
            if not isinstance(cause, UnavailableError):
                # Alive but silent (the liveness watch's UnresponsiveError): this client can no
                # longer use it, so it is stopped and restarted like a dead one.
                self.expect_kill = True
                await self._rt.scheduler.remove_workers([worker.worker_id])
            ended = await self._ended(worker)
            if ended is not None and ended.exit.requested and not self.expect_kill:
                self.stopped = True  # ray.kill from another process: gone for good, as in Ray
                raise died_for_good(self.wname, self.restarts, self.max_restarts, "it was killed (ray.kill)")
            self.expect_kill = False
            with contextlib.suppress(Exception):
                await worker.client.close()
            rt.deathwatch.forget([worker.worker_id])
            self.restarts += 1
            info = await self._place()
            from podium.controller.group import build as _build
            await _build.connect(rt, group._members, [info])
            self.worker_id = info.id
            self._rearm(group)
            self.watch()
            try:
                await construct(group, self._make_payload())
            except RemoteError as exc:  # the constructor raised: as Ray, the actor is dead
                raise died_for_good(self.wname, self.restarts, self.max_restarts,
                                    f"its constructor failed on restart {self.restarts}: {exc}") from None
            log.info("actor %s restarted (%d of %s) in %.2f s on %s", self.wname, self.restarts,
                     "unlimited" if self.max_restarts < 0 else self.max_restarts, time.monotonic() - started,
                     info.node_address)
            future.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - every caller waiting on it gets the error
            dead = exc if isinstance(exc, WorkerDiedError) else died_for_good(
                self.wname, self.restarts, self.max_restarts, f"{type(exc).__name__}: {exc}")
            self.dead = dead
            if not self.stopped:
                await self._remove_for_good(group)
            future.set_exception(dead)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _ended(self, worker: Any) -> Any:
        """Wait until the scheduler records the old worker's end (its name and slot free);
        its last WorkerInfo (None when the scheduler forgot it)."""
        from podium.v1 import common_pb2
        ended = (common_pb2.WORKER_EXITED, common_pb2.WORKER_FAILED)
        started = time.monotonic()
        deadline = started + _EXIT_WAIT_SECONDS
        asked_stop = False
        while True:
            infos = await self._rt.scheduler.get_workers(ids=[worker.worker_id])
            if not infos or infos[0].state in ended:
                return infos[0] if infos else None
            if not asked_stop and time.monotonic() > started + 5:
                asked_stop = True  # unreachable, not reported dead: make sure it is stopped
                with contextlib.suppress(Exception):
                    await self._rt.scheduler.remove_workers([worker.worker_id])
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"actor {self.wname}: its worker {worker.worker_id} has no exit record "
                                      f"after {_EXIT_WAIT_SECONDS:g} s, so it cannot be restarted under its name")
            await asyncio.sleep(0.05)

    async def _place(self) -> Any:
        """The new worker, in the actor's bundle (a new own placement group when its node is gone)."""
        try:
            return await create_worker(self._rt, self._opts, self.wname, self._pg_id, self._bundle,
                                               restarts=self.restarts)
        except (FailedPreconditionError, NotFoundError):
            if not self.own_pg:
                raise
        # The node of its own placement group is gone: a new group wherever it fits.
        with contextlib.suppress(Exception):
            await self._rt.scheduler.remove_placement_group(self.own_pg)
        pg_id, bundle, own = await reserve(self._rt, self._opts, self.wname)
        self._pg_id, self._bundle, self.own_pg = pg_id, bundle, own
        return await create_worker(self._rt, self._opts, self.wname, pg_id, bundle, restarts=self.restarts)

    def _rearm(self, group: Any) -> None:
        """Point the actor's lifetime (its last handle gone: stop it) at the new worker."""
        from podium.controller.group import life as _life
        if group._life is None:
            return
        group._life.disarm()
        group._life = _life.arm(self._rt, group.workers, group._gid, group._pg_ids,
                                [self.own_pg] if self.own_pg else [])

    async def _remove_for_good(self, group: Any) -> None:
        """The actor will not come back: its worker and own placement group go."""
        if group._life is not None:
            group._life.disarm()
        with contextlib.suppress(Exception):
            await remove(self._rt, group, self.own_pg)
        if _by_name.get(self.wname) is self:
            del _by_name[self.wname]


def is_death(exc: BaseException | None) -> bool:
    """Whether a call's error means its worker is gone (not that the method raised)."""
    from podium.errors import UnavailableError
    return isinstance(exc, UnavailableError)
