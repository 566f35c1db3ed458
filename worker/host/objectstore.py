"""Values held in one process and served to whoever fetches their refs.

Two kinds of process hold values for ``put``: a worker (its host's own store of held
results) and a controller (a store of its own, behind the same ``podium.v1.Worker`` service
a worker runs, with no hosted object and its ``Calls`` stream refused: a controller serves
``Describe``, ``Fetch`` and ``Release`` and runs no code it is sent). :func:`object_store`
gives either as one :class:`ObjectStore`; it is the one entry into the worker host that the
controller uses.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from podium.v1 import worker_pb2

__all__ = ["ObjectStore", "StoreServer", "object_store"]


@dataclasses.dataclass(frozen=True)
class StoreServer:
    """Where and how a store of its own serves its values: the host to bind (on a free port),
    the cluster token, TLS settings (``podium.auth.TlsConfig`` or None) and the name it is
    known by in refs (a worker id)."""

    host: str
    token: str
    tls: Any
    owner: str


class ObjectStore:
    """Held values of one process, each fetched by its ref from :attr:`address`."""

    def __init__(self, runtime: Any, server: StoreServer | None = None) -> None:
        self._runtime = runtime  # a podium.worker.host.runtime.HostRuntime
        self._spec = server
        self._server: Any = None

    @property
    def address(self) -> str:
        """"host:port" that consumers fetch from."""
        return str(self._runtime.address)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the store's releases run on."""
        return self._runtime.loop

    @property
    def stats(self) -> dict[str, Any]:
        """The host's counters (calls served, fetches served, bytes), a copy taken now."""
        return self._runtime.book.stats_now()

    def holds(self, object_id: str) -> bool:
        """Whether the value ``object_id`` is held here."""
        return object_id in self._runtime.held

    @property
    def held_count(self) -> int:
        """How many values are held here now."""
        return len(self._runtime.held)

    @property
    def held_bytes(self) -> tuple[int, int]:
        """Bytes of the values held here now, and the most this process may hold."""
        return self._runtime.held.used_bytes, self._runtime.held.budget_bytes

    def kept_for_borrowers(self, object_id: str) -> bool:
        """Whether ``object_id`` is held only for other processes that borrowed its ref."""
        return self._runtime.held.kept_for_borrowers(object_id)

    def hold(self, value: Any) -> worker_pb2.ObjectRefInfo:
        """Hold a snapshot of ``value`` and return its ref's description."""
        return self._runtime.hold_value(value)

    def release(self, object_ids: list[str]) -> int:
        """Release held values (on :attr:`loop`); how many there were."""
        return self._runtime.release_held(object_ids)

    def local_value(self, object_id: str, rows: tuple[int, int] | None) -> Any:
        """A fresh copy of a held value, or of a row range of it (no RPC)."""
        from podium import codec

        _, encoded = self._runtime.fetch_value(object_id, rows)
        return codec.decode(bytearray(b"".join(encoded.to_segments())))

    async def start(self) -> None:
        """Start serving (a store of its own; on the loop that will run it)."""
        import grpc

        from podium import rpc
        from podium.v1 import worker_pb2_grpc
        from podium.worker.host.servicer import WorkerServicer

        assert self._spec is not None, "a worker's own store is served by its worker"

        class ObjectServicer(WorkerServicer):
            async def Calls(self, request_iterator, context):  # noqa: N802 - the gRPC method name
                await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                    "the controller's object server serves Fetch and Release only")

        from podium.worker.host.borrowerwatch import BorrowerWatch

        self._runtime.borrower_watch = BorrowerWatch(self._runtime.held, self._spec.token, self._spec.tls)
        server, health = rpc.make_server(self._spec.token)
        worker_pb2_grpc.add_WorkerServicer_to_server(ObjectServicer(self._runtime), server)
        host = self._spec.host
        port = rpc.bind(server, host, 0, self._spec.tls)
        self._runtime.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        await rpc.start_server(server, health)
        self._server = server

    async def close(self) -> None:
        """Stop serving and drop every held value (a store of its own)."""
        if self._server is not None:
            await self._server.stop(0.5)
            self._runtime.close()


#: The store of each worker host of this process (one in a worker; tests start several).
_worker_stores: dict[int, ObjectStore] = {}


def object_store(server: StoreServer | None = None) -> ObjectStore | None:
    """With no argument: the store of the worker this process runs (None outside a worker).
    With ``server``: a new store of its own, served once ``await store.start()`` ran on the
    loop that runs it."""
    if server is None:
        from podium.worker.host.process import current_host

        host = current_host()
        if host is None:
            return None
        store = _worker_stores.get(id(host))
        if store is None or store._runtime is not host:
            store = _worker_stores[id(host)] = ObjectStore(host)
        return store
    from podium.worker.host.config import HostConfig
    from podium.worker.host.heldstore import default_budget
    from podium.worker.host.runtime import HostRuntime

    config = HostConfig(rank=-1, worker_id=server.owner, node_address=server.host,
                        hold_budget_bytes=default_budget())
    return ObjectStore(HostRuntime(config), server)
