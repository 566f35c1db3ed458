"""``get`` and ``wait`` (Ray's ``ray.get`` and ``ray.wait``) over pending results, refs and
futures: from the controller's thread, through the session's loop; in a worker that has no
session of its own, refs that arrived there are fetched by its host.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from podium.controller.session.futures import (_PENDING, PendingDataProtoFuture, PendingRef, _aget_value, _board,
                                               first_failed, is_pending, wait_all)
from podium.errors import DeadlineExceededError, InvalidArgumentError
from podium.refs import ObjectRef
from podium.tracering import RING, now_ns

if TYPE_CHECKING:
    from podium.controller.session.contract import Session

__all__ = ["get", "wait"]


def get(refs_or_future: Any, timeout: float | None = None) -> Any:
    """The value(s) of refs or futures (``ray.get``): a list in, a list out.

    Accepts PendingRef, ObjectRef, DataProtoFuture (pending or not), or a list of them;
    other values are returned unchanged. ``timeout`` defaults to the runtime's call timeout
    (none unless one was set: a get waits while the workers it waits on live);
    DeadlineExceededError when it runs out.
    """
    from podium.controller.session import runtime
    from podium.controller.session.calltimeout import effective_call_timeout
    from podium.worker.host import object_store
    if not runtime.is_initialized() and _only_held(refs_or_future) and object_store() is not None:
        # Refs that arrived in a worker: fetched by its host, no session of its own needed.
        from podium.refs import get_resolver
        many = isinstance(refs_or_future, (list, tuple))

        async def fetch_all() -> Any:
            values = [await _aget_value(v) for v in (refs_or_future if many else [refs_or_future])]
            return values if many else values[0]
        return get_resolver().run_sync(fetch_all(), timeout)
    rt = runtime.get_runtime()
    if timeout is None:  # a `with call_timeout(s):` block's, else the runtime's
        timeout = effective_call_timeout(rt.call_timeout)
    started = now_ns() if RING.on else 0
    many = isinstance(refs_or_future, (list, tuple))
    items = refs_or_future if many else [refs_or_future]
    try:
        values = _get_inline(rt, items, timeout)
        if values is not None:
            return values if many else values[0]
        if timeout is not None and timeout <= 0 and all(_done(v) for v in items):
            # Ray's timeout=0: no wait for a call, but a finished one's value is fetched.
            timeout = effective_call_timeout(rt.call_timeout)
        if many:

            async def all_of():
                return list(await asyncio.gather(*(_aget_value(v) for v in refs_or_future)))
            return rt.run(all_of(), timeout=timeout, what="get")
        return rt.run(_aget_value(refs_or_future), timeout=timeout, what="get")
    finally:
        if started:
            count = len(refs_or_future) if isinstance(refs_or_future, (list, tuple)) else 1
            RING.add("get", f"{count} ref{'s' if count != 1 else ''}", started, now_ns())


def _only_held(value: Any) -> bool:
    """Whether ``value`` (or each item of a list) is a ref of a held value, or no ref at all:
    nothing a session of this process made."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return not any(is_pending(v) for v in items)


def _get_inline(rt: Session, values: list | tuple, timeout: float | None) -> list | None:
    """``get`` of refs that all carry their value inline, right here in the calling thread
    (no hop to the loop thread, no coroutine per ref); None when some ref needs a fetch."""
    if not all(type(v) is PendingRef or type(v) is ObjectRef for v in values):
        return None
    pending = [v for v in values if type(v) is PendingRef and v._state == _PENDING]
    failed = first_failed(values)
    if pending and failed is None:
        if not wait_all(pending, timeout):
            raise DeadlineExceededError(f"get did not finish within {timeout:g}s")
        failed = first_failed(values)
    if failed is not None:  # fail fast: the others may still run (their refs stay valid)
        failed._result()
    refs = [v._result() if type(v) is PendingRef else v for v in values]  # raises a call's error
    if not all(r.inline is not None for r in refs):
        return None
    from podium.refs import inline_value
    out = [inline_value(r) for r in refs]
    rt.stats["fetches"] += len(refs)
    rt.stats["fetched_bytes"] += sum(len(r.inline or b"") for r in refs)
    return out


def _done(value: Any) -> bool:
    if isinstance(value, (PendingRef, PendingDataProtoFuture)):
        return value.done()
    return True


def _underlying(values: Iterable[Any]) -> list[PendingRef]:
    out = []
    for value in values:
        if isinstance(value, PendingRef):
            out.append(value)
        elif isinstance(value, PendingDataProtoFuture):
            out.extend(value._pending_refs())
    return out


def wait(refs: list, num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
    """Wait until ``num_returns`` of ``refs`` are done or ``timeout`` passes (``ray.wait``).

    Returns ``(ready, not_ready)`` keeping the input order within each list. A finished call
    counts as ready even when it failed (``get`` raises its error).
    """
    refs = list(refs)
    if not 0 <= num_returns <= len(refs):
        raise InvalidArgumentError(f"num_returns must be in [0, {len(refs)}] (the number of refs), got {num_returns}")
    deadline = None if timeout is None else time.monotonic() + timeout
    underlying = _underlying(refs)
    with _board:
        while True:
            for ref in underlying:
                ref._watched = True  # before reading their state: see PendingRef._settle
            ready = [r for r in refs if _done(r)]
            if len(ready) >= num_returns:
                break
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            _board.wait(remaining)
    ready_ids = {id(r) for r in ready[:num_returns]} if num_returns else set()
    ready_list = [r for r in refs if id(r) in ready_ids]
    return ready_list, [r for r in refs if id(r) not in ready_ids]
