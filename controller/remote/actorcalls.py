"""Calls that outlive a worker's death: actor calls under Ray's ``max_restarts`` /
``max_task_retries`` rules, and tasks under ``max_retries`` / ``retry_exceptions``.

:func:`call_with_retries` returns one ref at once and settles it with the last attempt: an
attempt whose worker died is sent again when the rules allow, and (with ``retry_exceptions``)
one whose function raised. Retries happen off the runtime's loop (sending may start a worker).

For an actor (:func:`actor_call`), as Ray does with ``max_task_retries=0``: a call in flight
when the actor died fails with ``ActorUnavailableError`` when the actor restarts, and with
``ActorDiedError`` (WorkerDiedError) naming the restart count when it will not. A call made
while it restarts waits for the restart and then runs (it never reached the dead worker,
so this costs no retry). With ``max_task_retries`` N (or -1), a call in flight is sent again
to the restarted actor up to N times. The owner waits for its own restart
(:mod:`.restarts`); a process that borrowed the handle finds the new worker by the actor's
name with the scheduler and attaches to it, so every handle keeps working.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from typing import Any, Callable

from podium.controller.remote.actorplace import attached
from podium.controller.remote.restarts import died_for_good, is_death, restarter_of
from podium.controller.session.futures import PendingRef
from podium.controller.session.runtime import get_runtime
from podium.errors import ActorUnavailableError, RemoteError, WorkerDiedError

__all__ = ["call_with_retries", "actor_call", "restartable", "exception_matches"]

#: Seconds between two looks at the scheduler while a borrower waits for a restart.
_POLL_SECONDS = 0.05


def exception_matches(err: BaseException, retry_exceptions: Any) -> bool:
    """Whether the user exception ``err`` (a RemoteError) is one ``retry_exceptions`` retries:
    True for any; for a tuple of classes, when the raised class (imported by its name where it
    can be) is one of them or a subclass, else when its name is one of theirs."""
    if not isinstance(err, RemoteError) or not retry_exceptions:
        return False
    if retry_exceptions is True:
        return True
    name = err.remote_type
    module, _, qualname = name.rpartition(".") if "." in name else ("builtins", "", name)
    raised = None
    try:
        raised = getattr(importlib.import_module(module or "builtins"), qualname)
    except Exception:  # noqa: BLE001 - a class this process cannot import: compared by name
        raised = None
    for cls in retry_exceptions:
        if isinstance(raised, type) and issubclass(raised, cls):
            return True
        full = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
        if full == name:
            return True
    return False


def _forward(inner: PendingRef, outer: PendingRef) -> None:
    """Settle ``outer`` with the succeeded ``inner``'s result; the held value is released when
    ``outer`` is garbage (not when ``inner`` is)."""
    outer._release, inner._release = inner._release, None
    outer.set_result(inner._outcome)


def call_with_retries(method: str, send: Callable[[], tuple[PendingRef, Any]], retries: int,
                      retry_exceptions: Any, on_death: Callable[[BaseException, Any, bool], Any],
                      keep: Any = None) -> PendingRef:
    """One ref for a call tried up to ``1 + retries`` times (-1: no limit).

    ``send()`` makes one attempt: its ref and a token (what it was sent to). When an attempt
    meets its worker's death, ``await on_death(error, token, a_retry_is_left)`` says what next: "free" (send
    again without counting a retry: it never ran), "retry" (send again if a retry is left, or
    fail with the error it returns as ``error`` otherwise); or it raises the error to give."""
    rt = get_runtime()
    outer = PendingRef(0, method)
    outer.keep = keep
    left = [retries]

    def attempt() -> None:
        if outer.done():  # cancelled (ray.cancel) meanwhile: nothing more is sent
            return
        try:
            inner, token = send()
        except BaseException as exc:  # noqa: BLE001 - reported through the ref
            outer.set_exception(exc)
            return
        inner.add_done_callback(lambda done: settled(done, token))

    def again() -> None:  # off the loop: sending may attach to a worker or start one
        threading.Thread(target=attempt, name="podium-retry", daemon=True).start()

    def take_retry() -> bool:
        if left[0] == 0:
            return False
        if left[0] > 0:
            left[0] -= 1
        return True

    def settled(inner: PendingRef, token: Any) -> None:
        err = inner.error()
        if outer.done():
            return  # cancelled meanwhile: the inner result is released with its own ref
        if err is None:
            _forward(inner, outer)
        elif is_death(err):
            asyncio.run_coroutine_threadsafe(after_death(err, token), rt.loop)
        elif exception_matches(err, retry_exceptions) and take_retry():
            again()
        else:
            outer.set_exception(err)

    async def after_death(err: BaseException, token: Any) -> None:
        try:
            verdict = await on_death(err, token, left[0] != 0)
        except BaseException as exc:  # noqa: BLE001 - the error the caller gets
            outer.set_exception(exc)
            return
        if verdict == "free" or take_retry():
            again()
        else:
            outer.set_exception(verdict if isinstance(verdict, BaseException) else err)

    attempt()
    return outer


def restartable(info: Any) -> bool:
    """Whether the actor whose (dead) worker ``info`` describes is restarted after its death:
    its incarnation's restart count is below max_restarts (or there is no limit)."""
    spec = info.spec
    return spec.max_restarts < 0 or spec.restarts < spec.max_restarts


def actor_call(handle: Any, method: str, args: tuple, kwargs: dict, retries: int,
               retry_exceptions: Any) -> PendingRef:
    """Call ``method`` on a restartable actor (see the module docstring)."""

    def send() -> tuple[PendingRef, Any]:
        group = handle._group
        worker = group.workers[0]
        broken = worker.client.broken is not None and group._calls.gate is None
        if broken:  # a borrower whose worker is known dead: wait for the restart first
            ref = PendingRef(0, method)
            ref.set_exception(worker.client.broken)
            return ref, (worker.info, True)
        ref = group._calls.run([0], method, [(args, kwargs)], blocking=False)[0]
        return ref, (worker.info, False)

    async def on_death(err: BaseException, token: Any, can_retry: bool) -> Any:
        info, never_sent = token
        restarter = restarter_of(info.spec.name)
        if restarter is not None and (restarter.stopped or restarter.dead is not None):
            raise restarter.dead or died_for_good(info.spec.name, restarter.restarts, restarter.max_restarts, err)
        if not restartable(info) or (restarter is None and await _stopped_on_purpose(info)):
            raise died_for_good(info.spec.name, info.spec.restarts, info.spec.max_restarts, err)
        if not never_sent and not can_retry:  # at most once: it may have run (Ray's rule)
            return ActorUnavailableError(
                f"actor {info.spec.name} died during {method} and is restarting "
                f"(restart {info.spec.restarts + 1} of "
                f"{'unlimited' if info.spec.max_restarts < 0 else info.spec.max_restarts}); the call may or may not "
                f"have run and is not sent again (max_task_retries=0): {err}",
                node=info.node_id, rank=0)
        if restarter is not None:
            await restarter.wait_replaced(info.id)
        else:
            await _reattach(handle, info)
        return "free" if never_sent else "retry"

    return call_with_retries(method, send, retries, retry_exceptions, on_death, keep=handle)


async def _stopped_on_purpose(info: Any) -> bool:
    """Whether the scheduler says this worker was stopped on request (kill, its owner gone)."""
    rt = get_runtime()
    try:
        infos = await rt.scheduler.get_workers(ids=[info.id])
    except Exception:  # noqa: BLE001 - unknown: assume it restarts (the wait is bounded)
        return False
    return bool(infos) and infos[0].exit.requested


#: One reattachment at a time per borrowed group (several failed calls share it).
_reattaching: dict[int, asyncio.Lock] = {}


async def _reattach(handle: Any, dead: Any) -> None:
    """In a process that borrowed the handle: wait for the actor's next worker (by name)
    and its constructor, and point the shared group at it."""
    from podium.controller.group import build as _build
    from podium.v1 import common_pb2

    rt = get_runtime()
    group = handle._group
    lock = _reattaching.setdefault(id(group), asyncio.Lock())
    async with lock:
        if group.workers[0].worker_id != dead.id:
            return  # another call already found the new worker
        wname = dead.spec.name
        deadline = time.monotonic() + 2 * rt.placement_timeout + 120
        ended = (common_pb2.WORKER_EXITED, common_pb2.WORKER_FAILED)
        while True:
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"actor {wname} did not come back within "
                                      f"{2 * rt.placement_timeout + 120:g} s of its death")
            infos = await rt.scheduler.get_workers(names=[wname])
            info = infos[0] if infos else None
            if info is not None and info.id != dead.id:
                if info.state == common_pb2.WORKER_RUNNING:
                    break
                if info.state in ended and (not restartable(info) or info.exit.requested):
                    raise died_for_good(wname, info.spec.restarts, info.spec.max_restarts, info.exit.reason)
            elif info is not None and info.state in ended and info.exit.requested:
                raise died_for_good(wname, info.spec.restarts, info.spec.max_restarts, info.exit.reason)
            await asyncio.sleep(_POLL_SECONDS)
        old = group.workers[0]
        rt.deathwatch.forget([old.worker_id])
        try:
            await old.client.close()
        except Exception:  # noqa: BLE001 - a dead worker's client
            pass
        await _build.connect(rt, group._members, [info])
        attached[info.id] = group
        while True:  # its owner runs the constructor: calls wait for it to start
            described = await group.workers[0].client.describe()
            if described.constructed:
                return
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"actor {wname}: its restarted worker was not constructed in time")
            await asyncio.sleep(_POLL_SECONDS)
