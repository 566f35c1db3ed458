"""A group's rendezvous seen from a worker: :class:`Rendezvous` (version, rank, world size,
MASTER_ADDR/MASTER_PORT, the versioned group name) and the hook that learns each new one.

When a WorkerGroup replaces a rank (``wg.replace_rank(i)``, or ``on_rank_death="replace"``),
every rank, old and new, gets the new rendezvous: Podium writes ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` into ``os.environ`` (and a :class:`~podium.worker.Worker`'s
rank), then calls each method of the hosted class marked ``@on_rendezvous`` with the
:class:`Rendezvous`, on every rank at once, so user code re-forms its ``torch.distributed``
group there (``destroy_process_group()``, then ``init_process_group(...)``).

The store of each version: ``init_process_group(store=rdzv.store(), rank=rdzv.rank,
world_size=rdzv.world_size)``. Rank 0 serves it (:mod:`podium.transport.authstore`: it
listens on the node address only, and every connection proves the version's key, which
travels only inside Podium's authenticated calls); a new version gets a new store. With
``env://`` (``MASTER_ADDR``/``MASTER_PORT``) or ``init_method=rdzv.init_method``, rank 0 serves
torch's own TCPStore on the MASTER_PORT socket it holds, bound to the node address only
(:mod:`podium.worker.masterstore`; the group's first MASTER_PORT comes the same way from the
node agent), but that store checks no key: anyone who reaches the node address and port can
read and write it.

The hook runs on each rank's execution thread, after the call in hand. A survivor still
blocked in a collective with the dead rank (gloo has no abort) delays it until that
collective fails, so: give ``init_process_group`` a ``timeout``, and have a rank whose
collective raised call ``destroy_process_group()`` before it re-raises: that closes its
connections, so the ranks waiting on it fail at once too.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import socket
from typing import Any, Callable, TypeVar

__all__ = ["Rendezvous", "on_rendezvous", "open_port", "adopt"]

F = TypeVar("F", bound=Callable[..., Any])

#: The attribute ``@on_rendezvous`` sets on a method.
MARK = "__podium_on_rendezvous__"

#: The port rank 0 bound for the next rendezvous (held until :func:`adopt` hands it over).
_held: socket.socket | None = None
#: Rank 0: the store it serves for the newest version (the one before is closed).
_server: Any = None
#: This rank's client of the newest version's store, with its (version, port): torch calls
#: back into the Python object, so it lives here until the next version replaces it.
_client: tuple[tuple[int, int], Any] | None = None
_client_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """One version of a group's rendezvous, as one rank sees it."""

    #: 0 at the group's start, +1 per replacement.
    version: int
    #: This worker's rank.
    rank: int
    #: Ranks in the group.
    world_size: int
    #: MASTER_ADDR of this version (rank 0's node).
    master_addr: str
    #: MASTER_PORT of this version (new with each version).
    master_port: int
    #: A name for this version's collective group: the group's name and the version.
    group_name: str
    #: The port of this version's store on ``master_addr`` (0: none; see :meth:`store`).
    store_port: int = 0
    #: The store's key (hex); it travels only in Podium's authenticated calls.
    store_key: str = dataclasses.field(default="", repr=False)

    def store(self, timeout: float = 300.0) -> Any:
        """This version's store, for ``init_process_group(store=..., rank=..., world_size=...)``:
        a ``torch.distributed.Store`` connected to the one rank 0 serves on the node address
        (HMAC-authenticated, :mod:`podium.transport.authstore`). One per version and process:
        a second call returns the same client; the next version's closes it. ``timeout``
        bounds each wait in the store (seconds)."""
        global _client
        from podium.errors import FailedPreconditionError
        if not self.store_port:
            raise FailedPreconditionError(
                f"rendezvous version {self.version} has no Podium store (torch was not importable in rank 0); "
                "use init_method=rdzv.init_method (torch's TCPStore, with no key)")
        from podium.transport.authstore import connect_store
        with _client_lock:
            if _client is not None and _client[0] == (self.version, self.store_port):
                return _client[1]
            client = connect_store(self.master_addr, self.store_port, self.store_key, timeout)
            old, _client = _client, ((self.version, self.store_port), client)
        if old is not None:
            old[1].close()
        return client

    @property
    def init_method(self) -> str:
        """``tcp://MASTER_ADDR:MASTER_PORT`` for ``init_process_group(init_method=...)``."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def on_rendezvous(fn: F) -> F:
    """Mark a method of a hosted class: called with each new :class:`Rendezvous` of its group."""
    setattr(fn, MARK, True)
    return fn


def open_port(_obj: Any, host: str) -> tuple[int, int, str]:
    """Run in rank 0 (``__ray_call__``): bind a rendezvous port on ``host`` (outside the
    ephemeral range, podium.worker.agent.ports) and hold it until :func:`adopt`, and serve
    a new store on ``host`` (the previous version's is closed). Returns (MASTER_PORT, the
    store's port, its key); without torch, the store's port is 0."""
    global _held, _server
    from podium.worker.agent.ports import bind_rendezvous_port
    if _held is not None:
        _held.close()
    _held = bind_rendezvous_port(host)
    if _server is not None:
        _server.close()
        _server = None
    try:
        from podium.transport.authstore import StoreServer, new_key
    except ImportError:  # torch is missing: env:// is all this group has
        return _held.getsockname()[1], 0, ""
    key = new_key()
    _server = StoreServer(host, key)
    return _held.getsockname()[1], _server.port, key


def adopt(obj: Any, rdzv: Rendezvous) -> int:
    """Run in every rank (``__ray_call__``): take ``rdzv`` (env, a Worker's rank); rank 0
    hands the held port to :mod:`podium.worker.masterstore`, which serves torch's store of
    the new MASTER_PORT on it (and lets the previous versions' go); then call the hosted
    object's ``@on_rendezvous`` methods. Returns how many hooks ran."""
    global _held
    os.environ.update(RANK=str(rdzv.rank), WORLD_SIZE=str(rdzv.world_size),
                      MASTER_ADDR=rdzv.master_addr, MASTER_PORT=str(rdzv.master_port))
    for attr, value in (("_rank", rdzv.rank), ("_world_size", rdzv.world_size),
                        ("_master_addr", rdzv.master_addr), ("_master_port", str(rdzv.master_port))):
        if hasattr(obj, attr):
            setattr(obj, attr, value)
    if _held is not None:  # rank 0: the hook's env:// or tcp:// init is served on it
        from podium.worker import masterstore
        for port in masterstore.held_ports():
            if port != rdzv.master_port:
                masterstore.release(port)  # an old version's (a store still serving keeps its own copy)
        masterstore.hold(_held)
        _held = None
    ran = 0
    for name in dir(type(obj)):
        method = getattr(type(obj), name, None)
        if callable(method) and getattr(method, MARK, False):
            getattr(obj, name)(rdzv)
            ran += 1
    return ran
