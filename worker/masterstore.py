"""torch's store of a group's MASTER_PORT, served by rank 0 on the socket its node agent bound
to the node address, so that the store listens on that address only and the port is never free
for another process to take (issue 51).

The agent binds MASTER_PORT on the node address, listening (``ReservePort``), and the group's
master (rank 0) inherits that socket: its number is in ``PODIUM_MASTER_LISTEN_FD``
(:data:`LISTEN_FD_ENV`), which the worker takes out of its environment at start
(:func:`take_listen_fd`), so no child of the worker sees it. The process keeps the socket for
its life: the port stays bound, and ranks that connect before rank 0 serves wait in its
backlog.

Once ``torch.distributed`` is imported in that process (at once when it already is, as in a
worker forked from the agent's fork server, which preloads torch; otherwise a one-shot import
hook, so a group that never uses torch pays no torch import), Podium wraps torch's ``env://``
and ``tcp://`` rendezvous handlers. When one of them asks rank 0 for the master store of a port
this process holds, the wrapper makes torch's own call with the socket added::

    TCPStore(MASTER_ADDR, MASTER_PORT, world_size, is_master=True, timeout=timeout,
             multi_tenant=True, use_libuv=..., master_listen_fd=os.dup(fd))

so user code's plain ``init_process_group("gloo")`` works as before, while the store listens
on the node address only (torch's own binds ``::`` or ``0.0.0.0``). Every other rendezvous (other
ranks, other ports, ``file://``, ``TORCHELASTIC_USE_AGENT_STORE``) goes to torch's handler
unchanged. As in torch, a live server of the port is reused (``multi_tenant``) and a new one
starts once the last store of the old one is gone (a destroyed and re-formed group starts from
empty keys); the new one serves a duplicate of the socket, since a server closes its
descriptor when it ends. (A duplicate passed while an old server still lives goes unused and
stays open: one descriptor of the same socket, no second listener.)

Why not torchrun's way, ``TORCHELASTIC_USE_AGENT_STORE=True`` (every rank a client of a store
hosted elsewhere): torch reads it on every rendezvous, ``tcp://`` on other ports included, and
child processes inherit it. vLLM's workers form their own group with ``tcp://ip:port``, whose
rank 0 must host a store; under that variable it would only connect, and wait until its
timeout. And a store kept alive beside the group would keep the keys of a destroyed group.
"""

from __future__ import annotations

import datetime
import importlib.abc
import logging
import os
import socket
import sys
import threading
from typing import Any, Callable, Iterator, MutableMapping
from urllib.parse import urlparse

__all__ = ["LISTEN_FD_ENV", "take_listen_fd", "hold", "release", "take", "held_ports"]

log = logging.getLogger(__name__)

#: The environment variable naming the inherited MASTER_PORT socket's fd (agent to worker).
LISTEN_FD_ENV = "PODIUM_MASTER_LISTEN_FD"
#: The module whose import installs the wrapped handlers.
TRIGGER = "torch.distributed"
#: The rendezvous schemes whose master store can be served on a held socket.
SCHEMES = ("env", "tcp")

#: Held MASTER_PORT sockets of this process, by port.
_held: dict[int, socket.socket] = {}
_lock = threading.Lock()
#: Whether torch's handlers are wrapped (once per process) or a hook waits for torch.
_installed = False


def take_listen_fd(environ: MutableMapping[str, str] = os.environ) -> None:
    """At a worker's start: take the MASTER_PORT socket the agent passed (if any) out of
    ``environ`` and :func:`hold` it. A descriptor that is not a socket bound to this worker's
    MASTER_PORT is closed, with a warning (torch then binds the port itself)."""
    given = environ.pop(LISTEN_FD_ENV, "")
    if not given:
        return
    try:
        sock = socket.socket(fileno=int(given))
        os.set_inheritable(sock.fileno(), False)  # a subprocess of the worker must not keep the port
        port = sock.getsockname()[1]
    except (ValueError, OSError, IndexError, TypeError) as exc:
        log.warning("%s=%r is not a bound socket (%s); torch binds MASTER_PORT itself", LISTEN_FD_ENV, given, exc)
        return
    if str(port) != environ.get("MASTER_PORT", ""):
        log.warning("the inherited socket is bound to port %d, not MASTER_PORT %s; closing it",
                    port, environ.get("MASTER_PORT"))
        sock.close()
        return
    hold(sock)


def hold(sock: socket.socket) -> None:
    """Keep ``sock`` (listening, bound to the node address; this module owns it now) and serve
    torch's store of its port on it whenever rank 0 of an ``env://`` or ``tcp://`` rendezvous
    asks for that port. Replaces a socket held for the same port."""
    global _installed
    port = sock.getsockname()[1]
    with _lock:
        old, _held[port] = _held.get(port), sock
        install = not _installed
        _installed = True
    if old is not None and old is not sock:
        old.close()
    if not install:
        return
    module = sys.modules.get(TRIGGER)
    if module is not None and hasattr(module, "TCPStore"):
        _wrap_handlers()
    else:
        sys.meta_path.insert(0, _AfterImport(TRIGGER, _wrap_handlers))


def release(port: int) -> bool:
    """Close the held socket of ``port`` (a store still serving it keeps its own duplicate);
    False when none is held."""
    with _lock:
        sock = _held.pop(port, None)
    if sock is None:
        return False
    sock.close()
    return True


def take(port: int) -> socket.socket | None:
    """The held socket of ``port``, handed over (the caller owns it now, and serves its own
    store on it: Podium's authenticated one, say); None when none is held."""
    with _lock:
        return _held.pop(port, None)


def held_ports() -> list[int]:
    """The ports whose socket this process holds."""
    with _lock:
        return sorted(_held)


def _wrap_handlers() -> None:
    """Wrap torch's ``env`` and ``tcp`` rendezvous handlers (once). torch offers no public way
    to replace a registered handler (``register_rendezvous_handler`` refuses a second one),
    so the registry itself is written; without it, the held sockets are released and torch
    binds the ports itself, as it would without Podium."""
    rendezvous = sys.modules.get("torch.distributed.rendezvous")
    handlers = getattr(rendezvous, "_rendezvous_handlers", None)
    if not isinstance(handlers, dict) or not all(s in handlers for s in SCHEMES):
        log.warning("torch.distributed.rendezvous has no handler registry to wrap; releasing MASTER_PORT "
                    "%s for torch's own store, which listens on every interface", held_ports())
        for port in held_ports():
            release(port)
        return
    for scheme in SCHEMES:
        if not getattr(handlers[scheme], "__podium_wrapped__", False):
            handlers[scheme] = _wrapped(scheme, handlers[scheme])


def _wrapped(scheme: str, original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    def handler(url: str, timeout: Any = None, **kwargs: Any) -> Iterator[Any]:
        if timeout is None:
            from torch.distributed.constants import default_pg_timeout
            timeout = default_pg_timeout
        found = _served_here(scheme, url)
        if found is None:
            return original(url, timeout=timeout, **kwargs)
        return _serve(*found, timeout=timeout)

    handler.__podium_wrapped__ = True  # type: ignore[attr-defined]
    handler.__wrapped__ = original  # type: ignore[attr-defined]
    return handler


def _served_here(scheme: str, url: str) -> tuple[str, int, int, bool, int] | None:
    """(host, port, world_size, use_libuv, fd) when ``url`` asks rank 0 for the store of a
    held port; None for everything torch's own handler should do."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None  # torchrun's agent hosts it: every rank is a client
    parsed = urlparse(url)
    query = dict(pair.split("=", 1) for pair in filter(None, parsed.query.split("&")) if "=" in pair)
    try:
        rank = int(query["rank"] if "rank" in query or scheme == "tcp" else os.environ["RANK"])
        world_size = int(query["world_size"] if "world_size" in query or scheme == "tcp"
                         else os.environ["WORLD_SIZE"])
        if scheme == "env":
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:
            host, port = parsed.hostname or "", int(parsed.port or 0)
    except (KeyError, ValueError):
        return None  # torch's handler names what is missing
    with _lock:
        sock = _held.get(port)
    if rank != 0 or sock is None or not host:
        return None
    use_libuv = query.get("use_libuv", os.environ.get("USE_LIBUV", "1")) == "1"
    return host, port, world_size, use_libuv, sock.fileno()


def _serve(host: str, port: int, world_size: int, use_libuv: bool, fd: int, *,
           timeout: datetime.timedelta) -> Iterator[Any]:
    from torch.distributed import TCPStore
    # A new server owns its descriptor and closes it when it ends, or when it fails to start
    # (so a failure does not close it here); the held one stays.
    store = TCPStore(host_name=host, port=port, world_size=world_size, is_master=True, timeout=timeout,
                     multi_tenant=True, use_libuv=use_libuv, master_listen_fd=os.dup(fd))
    log.info("rank 0 serves torch's store of MASTER_PORT %d on %s only", port, host)
    yield store, 0, world_size
    from podium.errors import UnimplementedError
    raise UnimplementedError(f"no re-rendezvous on MASTER_PORT {port} (torch's env:// and tcp:// have none either)")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then`` right after module ``name`` is executed by its first import (once)."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        """The module's own spec, its loader wrapped; None for every other module."""
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once, and the lookup below must not find this finder
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """A module's loader that calls ``then`` once the module has been executed."""

    def __init__(self, inner: Any, then: Callable[[], None]) -> None:
        self._inner = inner
        self._then = then

    def create_module(self, spec: Any) -> Any:
        """The inner loader's module."""
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        """Execute the module, then call ``then`` (its failure is logged, never raised into
        the import)."""
        self._inner.exec_module(module)
        try:
            self._then()
        except Exception:  # noqa: BLE001 - serving is Podium's concern, not the importer's
            log.exception("after importing %s", module.__name__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
