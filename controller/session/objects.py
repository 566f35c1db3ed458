"""The session's objects: values ``put`` here, held in this process and served to whoever
resolves their refs, and the refs that release them.

The first ``put`` in a controller starts an object store with a server of its own (the
worker host's :func:`~podium.worker.host.object_store`: the same ``podium.v1.Worker``
service a worker process runs, with no hosted object), so consumers fetch a put value
exactly as they fetch a held result (shared memory when they share this host, chunked TCP
otherwise), each consumer once per use. The caller gets an :class:`OwnedRef`, an
:class:`~podium.refs.ObjectRef` that releases the value when it is garbage collected (copies
pickled into call arguments are plain ObjectRefs: the owner's ref stays alive until every
call it was passed to has finished: ``podium.controller.session.futures.refs_inside``).

The object server binds ``PODIUM_CONTROLLER_HOST`` when set, else the address this host uses
to reach the scheduler (127.0.0.1 for an embedded cluster), on a free port.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from podium.errors import InvalidArgumentError
from podium.refs import DataProtoFuture, ObjectRef, keep_if_exported, own
from podium.worker.host import ObjectStore, StoreServer, object_store

if TYPE_CHECKING:
    from podium.controller.session.core import SessionCore

__all__ = ["OwnedRef", "ObjectServer", "hold", "controller_host"]


class OwnedRef(ObjectRef):
    """An ObjectRef whose value this process holds: released when this ref is garbage.

    Pickled (into call arguments, to other processes) it is a plain ObjectRef; pickled into a
    ``put`` value it is kept, with its value, as long as that value is held (Ray's refs
    contained in an object), and into a worker's result until this process ends
    (:func:`podium.refs.keep_if_exported`). Unpickled here again (a value fetched back) it is
    this same ref (:func:`podium.refs.own`)."""

    def __reduce__(self):
        keep_if_exported(self)
        return super().__reduce__()


class _LocalReleaser:
    """Releases values of dropped OwnedRefs on the owning loop (a finalizer may run in any
    thread, at any allocation: it only queues, the loop releases)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, release: Callable[[list[str]], int]) -> None:
        self._loop = loop
        self._release = release
        self._queued: collections.deque = collections.deque()
        #: How many values were released (tests and stats read it).
        self.released = 0

    def add(self, object_id: str) -> None:
        self._queued.append(object_id)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing is held any more
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        ids = []
        while self._queued:
            ids.append(self._queued.popleft())
        if ids:
            self.released += self._release(ids)


#: The releaser of each store of this process, by id (a store lives as long as its process).
_releasers: dict[int, _LocalReleaser] = {}


def hold(store: ObjectStore, value: Any) -> OwnedRef:
    """Hold a snapshot of ``value`` in ``store`` and return the ref that releases it. The refs
    inside ``value`` are kept, with their values, until this one is released."""
    if isinstance(value, (ObjectRef, DataProtoFuture)) or type(value).__name__ in (
            "PendingRef", "PendingDataProtoFuture"):
        raise InvalidArgumentError(f"put() takes a value, not a ref ({type(value).__name__}): pass the "
                                   "ref itself where the value is needed")
    releaser = _releasers.get(id(store))
    if releaser is None:
        releaser = _releasers[id(store)] = _LocalReleaser(store.loop, store.release)
    info = store.hold(value)
    ref = OwnedRef(info.object_id, info.worker_id, info.owner_address, info.owner_rank, info.size_bytes,
                   info.rows, info.inline_value or None)
    weakref.finalize(ref, releaser.add, info.object_id).atexit = False
    own(ref)
    return ref


def controller_host(scheduler_address: str, embedded: bool) -> str:
    """The address workers reach this controller on (see the module docstring)."""
    chosen = os.environ.get("PODIUM_CONTROLLER_HOST")
    if chosen:
        return chosen
    if embedded:
        return "127.0.0.1"
    host = scheduler_address.rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # no packet is sent: this only picks the route
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class ObjectServer:
    """The session's object store and its server (started on first use)."""

    def __init__(self, session: "SessionCore") -> None:
        self._session = session
        self._lock = threading.Lock()
        #: The store holding the values, once started.
        self.store: ObjectStore | None = None

    @property
    def address(self) -> str:
        """"host:port" of the server ("" until the first put)."""
        return self.store.address if self.store is not None else ""

    def _ensure(self) -> ObjectStore:
        with self._lock:
            if self.store is None:
                self._session.run(self._start(), timeout=60, what="starting the controller's object server")
            assert self.store is not None
            return self.store

    async def _start(self) -> None:
        session = self._session
        host = controller_host(session.address, embedded=session.embedded)
        store = object_store(StoreServer(host, session.token, session.tls, f"controller:{session.session_id}"))
        assert store is not None
        await store.start()
        self.store = store

    def put(self, value: Any) -> OwnedRef:
        """Hold ``value`` here; its ref is fetched from this server."""
        return hold(self._ensure(), value)

    def local_value(self, ref: ObjectRef, rows: tuple[int, int] | None) -> Any:
        """A fresh copy of a value this server holds (no RPC to itself)."""
        assert self.store is not None
        return self.store.local_value(ref.object_id, rows)

    async def close(self) -> None:
        """Stop serving and drop every held value."""
        if self.store is not None:
            await self.store.close()

