"""``podium.put`` (Ray's ``ray.put``): a value held where the caller runs, served to whoever
resolves its ref.

In a worker process (a method calling ``put``) the value is held in that worker's own store;
in a controller, in the session's object store (:mod:`podium.controller.session.objects`),
started on the first ``put``. Either way the caller gets an
:class:`~podium.controller.session.objects.OwnedRef` that releases the value when it is
garbage.
"""

from __future__ import annotations

from typing import Any

from podium.controller.session import runtime
from podium.controller.session.objects import OwnedRef, hold
from podium.errors import FailedPreconditionError
from podium.tracering import RING, now_ns
from podium.worker.host import object_store

__all__ = ["put"]


def put(value: Any) -> OwnedRef:
    """Hold ``value`` where this runs (``ray.put``): in the controller, or in the worker
    whose method calls it. Returns its ref, usable wherever a result ref is."""
    store = object_store()
    if store is not None and not runtime.is_initialized():
        return hold(store, value)
    session = runtime.get_runtime()
    if session.closed:
        raise FailedPreconditionError("the podium runtime is shut down; call init()")
    started = now_ns() if RING.on else 0
    ref = session.objects.put(value)
    if started:
        RING.add("put", type(value).__name__, started, now_ns())
    return ref
