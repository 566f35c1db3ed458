"""``podium.put``: values held where they were put, served to whoever resolves their ref.

In the controller, the first ``put`` starts an *object server* on the runtime's loop: the
same ``podium.v1.Worker`` service a worker process runs (a
:class:`~podium.worker.host.servicer.WorkerServicer` over a
:class:`~podium.worker.host.runtime.HostRuntime`), with no
hosted object, so consumers fetch a put value exactly as they fetch a held result (shared
memory when they share this host, chunked TCP otherwise), each consumer once per use. In a
worker process ``put`` holds the value in that worker's own store. Either way the caller
gets an :class:`OwnedRef`, an :class:`~podium.refs.ObjectRef` that releases the value when
it is garbage collected (copies pickled into call arguments are plain ObjectRefs: the
owner's ref stays alive until every call it was passed to has finished).

This module sits below :mod:`podium.controller.runtime` (whose session owns an
:class:`ObjectServer`); the runtime tells it, when imported, how ``put`` reaches the session
(:func:`serve_puts_from`), so neither imports the other both ways.

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
from typing import Any

from podium.errors import FailedPreconditionError, InvalidArgumentError
from podium.refs import DataProtoFuture, ObjectRef

__all__ = ["OwnedRef", "ObjectServer", "put", "controller_host", "owned_refs_in", "serve_puts_from"]


class OwnedRef(ObjectRef):
    """An ObjectRef whose value this process holds: released when this ref is garbage.

    Pickled (into call arguments, to other processes) it is a plain ObjectRef."""


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


def _owned(info: Any, releaser: _LocalReleaser) -> OwnedRef:
    ref = OwnedRef(info.object_id, info.worker_id, info.owner_address, info.owner_rank, info.size_bytes,
                   info.rows, info.inline_value or None)
    weakref.finalize(ref, releaser.add, info.object_id).atexit = False
    return ref


def _hold(host: Any, releaser: _LocalReleaser, value: Any) -> OwnedRef:
    """Encode ``value`` and hold a snapshot of it in ``host``'s store (a HostRuntime)."""
    if isinstance(value, (ObjectRef, DataProtoFuture)) or type(value).__name__ in (
            "PendingRef", "PendingDataProtoFuture"):
        raise InvalidArgumentError(f"put() takes a value, not a ref ({type(value).__name__}): pass the "
                                   "ref itself where the value is needed")
    return _owned(host.hold_value(value), releaser)


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


def _object_servicer(base: type) -> type:
    """The Worker service with its Calls stream refused: the controller serves Describe, Fetch
    and Release of put values, and runs no code it is sent."""
    import grpc

    class ObjectServicer(base):
        async def Calls(self, request_iterator, context):  # noqa: N802 - the gRPC method name
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "the controller's object server serves Fetch and Release only")

    return ObjectServicer


class ObjectServer:
    """The controller's object store and its Worker-service server (started on first use)."""

    def __init__(self, runtime: Any) -> None:
        self._rt = runtime
        self._lock = threading.Lock()
        #: The host runtime holding the values (no hosted object), once started.
        self.runtime: Any = None
        self._server: Any = None
        self.releaser: _LocalReleaser | None = None

    @property
    def address(self) -> str:
        """"host:port" of the server ("" until the first put)."""
        return self.runtime.address if self.runtime is not None else ""

    def _ensure(self) -> None:
        with self._lock:
            if self.runtime is None:
                self._rt.run(self._start(), timeout=60, what="starting the controller's object server")

    async def _start(self) -> None:
        from podium import rpc
        from podium.v1 import worker_pb2_grpc
        from podium.worker.host.heldstore import default_budget
        from podium.worker.host.config import HostConfig
        from podium.worker.host.runtime import HostRuntime
        from podium.worker.host.servicer import WorkerServicer

        host = controller_host(self._rt.address, embedded=bool(self._rt.processes))
        config = HostConfig(rank=-1, worker_id=f"controller:{self._rt.session_id}", node_address=host,
                            hold_budget_bytes=default_budget())
        runtime = HostRuntime(config)
        server, health = rpc.make_server(self._rt.token)
        worker_pb2_grpc.add_WorkerServicer_to_server(_object_servicer(WorkerServicer)(runtime), server)
        port = rpc.bind(server, host, 0, self._rt.tls)
        runtime.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        await rpc.start_server(server, health)
        self._server = server
        self.releaser = _LocalReleaser(runtime.loop, runtime.release_held)
        self.runtime = runtime

    def put(self, value: Any) -> OwnedRef:
        """Hold ``value`` here; its ref is fetched from this server."""
        self._ensure()
        assert self.releaser is not None  # made with the server
        return _hold(self.runtime, self.releaser, value)

    def local_value(self, ref: ObjectRef, rows: tuple[int, int] | None) -> Any:
        """A fresh copy of a value this server holds (no RPC to itself)."""
        from podium import codec

        _, encoded = self.runtime.fetch_value(ref.object_id, rows)
        return codec.decode(bytearray(b"".join(encoded.to_segments())))

    async def close(self) -> None:
        """Stop serving and drop every held value."""
        if self._server is not None:
            await self._server.stop(0.5)
            self.runtime.close()


_worker_releasers: dict[int, _LocalReleaser] = {}


class _SessionHook:
    """How put() reaches the controller's session (see :func:`serve_puts_from`)."""

    def __init__(self) -> None:
        self.initialized: Callable[[], bool] = lambda: False
        self.get: Callable[[], Any] | None = None


_session = _SessionHook()


def serve_puts_from(initialized: Callable[[], bool], get: Callable[[], Any]) -> None:
    """Called by :mod:`podium.controller.runtime` when it is imported: ``initialized()`` says
    whether this process has a session, ``get()`` returns it (starting one, as Ray's first use
    does), whose ``objects`` is its :class:`ObjectServer`."""
    _session.initialized = initialized
    _session.get = get


def put(value: Any) -> OwnedRef:
    """Hold ``value`` where this runs (``ray.put``): in the controller, or in the worker
    whose method calls it. Returns its ref, usable wherever a result ref is."""
    from podium.worker.host.process import current_host

    host = current_host()
    if host is not None and not _session.initialized():
        releaser = _worker_releasers.get(id(host))
        if releaser is None:
            releaser = _worker_releasers[id(host)] = _LocalReleaser(host.loop, host.release_held)
        return _hold(host, releaser, value)
    if _session.get is None:  # (podium.controller imports the runtime: not seen in practice)
        raise FailedPreconditionError("podium.put() outside a worker needs the controller's session: "
                                      "import podium.controller and call podium.init()")
    rt = _session.get()
    if rt._closed:
        raise FailedPreconditionError("the podium runtime is shut down; call init()")
    from podium.tracering import RING, now_ns
    started = now_ns() if RING.on else 0
    ref = rt.objects.put(value)
    if started:
        RING.add("put", type(value).__name__, started, now_ns())
    return ref


def owned_refs_in(per_rank: list) -> list[OwnedRef]:
    """The OwnedRefs among the top-level arguments of per-rank ``(args, kwargs)`` (a call keeps
    them alive until it finished, so their values outlive the caller's own refs)."""
    found = []
    for args, kwargs in per_rank:
        for v in (*args, *kwargs.values()):
            if type(v) is OwnedRef:
                found.append(v)
    return found
