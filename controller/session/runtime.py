"""The controller runtime: ``init()``/``shutdown()``, the event-loop thread, the session.

``init()`` is Podium's ``ray.init()``. With an address (argument or ``PODIUM_ADDRESS``) it
joins a running cluster; without one it starts an *embedded* cluster: one scheduler and one
node agent on 127.0.0.1, as child processes with a fresh random token, faking GPUs when NVML
finds none. Either way it opens a controller session (kept alive in the background); what
the session creates (placement groups, workers) is removed when it closes, and the scheduler
reclaims it if this process dies without closing.

Every gRPC client of the controller runs on ONE background thread with a uvloop event
loop; the synchronous API submits coroutines there and waits with a deadline (the default
call timeout comes from ``init(call_timeout=...)`` or ``PODIUM_CALL_TIMEOUT``; by default a
call waits as long as its worker lives, as in Ray: :mod:`~podium.controller.session.calltimeout`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Coroutine

from podium.controller.session import gcfreeze
from podium.controller.session.calltimeout import parse_call_timeout
from podium.controller.session.deathwatch import DeathWatch
from podium.controller.session.embedded import (DEFAULT_FAKE_GPUS, STARTUP_TIMEOUT, _start_embedded,  # noqa: F401
                                        _stop_process)
from podium.controller.session.objects import ObjectServer
from podium.controller.session.resolver import Resolver
from podium.controller.session.releaser import Releaser
from podium.errors import DeadlineExceededError, FailedPreconditionError, InvalidArgumentError

if TYPE_CHECKING:
    from podium.scheduler.client import SchedulerClient

__all__ = ["init", "shutdown", "is_initialized", "get_runtime", "Runtime", "DEFAULT_CALL_TIMEOUT"]

log = logging.getLogger("podium.controller")

#: Default deadline of one synchronous API call: none (a call waits while its worker lives).
DEFAULT_CALL_TIMEOUT: float | None = None
#: Deadline of waiting for a placement group / for workers to start.
PLACEMENT_TIMEOUT = float(os.environ.get("PODIUM_PLACEMENT_TIMEOUT", "300"))


def scheduler_timeout() -> float:
    """Deadline of one scheduler call of the controller, and so how long it waits for a
    scheduler that is down (``PODIUM_SCHEDULER_TIMEOUT``, 30 s; at most an hour)."""
    from podium.limits import check_seconds
    from podium.scheduler.client import DEFAULT_TIMEOUT

    raw = os.environ.get("PODIUM_SCHEDULER_TIMEOUT")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        raise InvalidArgumentError(f"PODIUM_SCHEDULER_TIMEOUT={raw!r} is not a number of seconds") from None
    return check_seconds(seconds, "PODIUM_SCHEDULER_TIMEOUT", 3600.0) or DEFAULT_TIMEOUT

_runtime: "Runtime | None" = None
_runtime_lock = threading.Lock()


class _LoopThread:
    """One daemon thread running a uvloop (or asyncio) event loop forever."""

    def __init__(self) -> None:
        try:
            import uvloop
            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="podium-controller-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)


class Runtime:
    """The controller's connection to a cluster (one per process; see :func:`init`)."""

    def __init__(self, *, address: str, token: str, call_timeout: float | None,
                 processes: list[subprocess.Popen] | None = None, log_dir: str | None = None,
                 tls: Any = None, session_lease: float = 0.0) -> None:
        self.address = address
        #: Lease asked for the session (0: the scheduler's default).
        self.session_lease = session_lease
        self.token = token
        #: podium.auth.TlsConfig for every channel (scheduler, workers), or None.
        self.tls = tls
        self.call_timeout = call_timeout
        self.placement_timeout = PLACEMENT_TIMEOUT
        self.log_dir = log_dir
        self.processes = list(processes or [])
        self.session_id = ""
        #: Controller-side counters: fetches made through the resolver, bytes they moved, and
        #: held results released because their PendingRefs were garbage collected.
        self.stats = {"fetches": 0, "fetched_bytes": 0, "released": 0}
        #: Whether init() froze the import-time heap (podium.controller.session.gcfreeze).
        self.gc_frozen = False
        self._loop_thread = _LoopThread()
        self.loop = self._loop_thread.loop
        #: Batches the release of held results whose refs were dropped.
        self.releaser = Releaser(self)
        #: Fails pending calls of workers the scheduler reports dead.
        self.deathwatch = DeathWatch(self)
        #: Values put() here (podium.controller.session.objects), served from this process.
        self.objects = ObjectServer(self)
        #: The scheduler's client (set by connect(), before anything else uses it).
        self.scheduler: SchedulerClient = None  # type: ignore[assignment]
        self._keepalive: asyncio.Task | None = None
        self._fetch_clients: dict[str, Any] = {}
        self._pools: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._groups: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._pg_users: dict[str, set[int]] = {}
        self._closed = False
        #: Streams of worker output to this terminal (podium.controller.session.logdriver), or None.
        self.log_to_driver: Any = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the session is over)."""
        return self._closed

    @property
    def embedded(self) -> bool:
        """Whether this session started its own cluster (its scheduler and agent children)."""
        return bool(self.processes)

    def groups(self) -> list[Any]:
        """The live WorkerGroups of this session."""
        return list(self._groups)

    # ---- running coroutines -----------------------------------------------------------

    def run(self, coro: Coroutine, timeout: float | None = None, *, what: str = "call") -> Any:
        """Run ``coro`` on the loop thread and wait for it, up to ``timeout`` seconds (None: as
        long as it runs; every coroutine the runtime runs has its own deadlines or ends when
        its peer is found dead)."""
        if self._closed:
            coro.close()
            raise FailedPreconditionError("the podium controller runtime is shut down; call init()")
        if threading.current_thread() is self._loop_thread.thread:
            coro.close()
            raise FailedPreconditionError("a blocking podium call was made on the runtime's own loop")
        future = self._loop_thread.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if future.done() and not future.cancelled():
                # The coroutine's own TimeoutError (DeadlineExceededError is one: the
                # builtin is concurrent.futures.TimeoutError): it says more than ours.
                raise
            future.cancel()
            raise DeadlineExceededError(f"{what} did not finish within {timeout:g}s") from None

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule ``coro`` on the loop thread without waiting."""
        return self._loop_thread.submit(coro)

    # ---- session ----------------------------------------------------------------------

    async def _open(self) -> None:
        from podium.scheduler.client import SchedulerClient
        # A scheduler restarting mid-job: each call waits for it within its deadline
        # (PODIUM_SCHEDULER_TIMEOUT, 30 s), then fails naming it (a group being created, say).
        self.scheduler = SchedulerClient(self.address, self.token, self.tls, wait_for_ready=True,
                                         timeout=scheduler_timeout())
        reply = await self.scheduler.open_session(
            # A submitted job's driver names its job: the scheduler closes it when the job ends.
            description=(f"job {os.environ['PODIUM_JOB_ID']}: " if os.environ.get("PODIUM_JOB_ID") else "")
            + f"controller pid {os.getpid()}: {' '.join(sys.argv)[:200]}",
            lease_seconds=self.session_lease)
        self.session_id = reply.session_id
        lease = reply.lease_seconds or 30.0
        self._keepalive = asyncio.get_running_loop().create_task(self._keep_alive(lease))

    async def _keep_alive(self, lease: float) -> None:
        interval = max(0.5, lease / 3)
        while True:
            await asyncio.sleep(interval)
            try:
                if not await self.scheduler.keep_alive(self.session_id):
                    log.error("podium session %s expired: its workers are gone", self.session_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the scheduler may be restarting: keep trying
                log.warning("podium session keep-alive failed: %s", exc)

    async def fetch_client(self, address: str):
        """A started WorkerClient to ``address`` for fetching refs (cached)."""
        client = self._fetch_clients.get(address)
        if client is None:
            from podium.worker.caller.client import WorkerClient
            client = WorkerClient(address, self.token, tls=self.tls)
            client.connect()
            self._fetch_clients[address] = client
        return client

    # ---- placement groups -------------------------------------------------------------

    async def create_placement_groups(self, pool, strategy: str, name: str | None) -> list[Any]:
        """Create one placement group per pool entry, wait for all, sort by node address."""
        from podium.controller.session.progress import Progress
        from podium.resources import sort_key_address
        created = []
        groups = len(pool.store)
        progress = Progress(f"resource pool ({groups} placement groups, {sum(pool.store)} bundles)")
        placed = 0

        async def wait(pg):
            nonlocal placed
            out = await self.scheduler.wait_placement_group(pg.id, timeout=self.placement_timeout)
            placed += 1
            progress.phase(f"{placed}/{groups} placement groups placed", count=True)
            return out

        try:
            progress.phase(f"creating {groups} placement groups")
            for i, n in enumerate(pool.store):
                pg = await self.scheduler.create_placement_group(
                    pool.pg_name(i, name), [pool.bundle()] * n, strategy,
                    detached=pool.detached, owner="" if pool.detached else self.session_id)
                created.append(pg)
            progress.phase(f"0/{groups} placement groups placed (waiting for free resources)")
            ready = await asyncio.gather(*(wait(pg) for pg in created))
        except BaseException:
            progress.done("failed")
            for pg in created:
                with contextlib.suppress(Exception):
                    await self.scheduler.remove_placement_group(pg.id)
            raise
        progress.done("placed")
        order = sorted(range(len(ready)), key=lambda i: (
            sort_key_address(ready[i].placements[0].node_address) if ready[i].placements else (3, 0, ""), i))
        return [ready[i] for i in order]

    def track_pool(self, pool) -> None:
        """Remember a pool with placement groups (reset when its groups are removed)."""
        self._pools.add(pool)

    def track_group(self, group) -> None:
        """Remember a live WorkerGroup (shut down with the runtime)."""
        self._groups.add(group)

    def acquire_pgs(self, user: int, pg_ids: list[str]) -> None:
        """Record that WorkerGroup ``user`` runs in these placement groups."""
        for pg_id in pg_ids:
            self._pg_users.setdefault(pg_id, set()).add(user)

    async def release_pgs(self, user: int, pg_ids: list[str]) -> None:
        """Forget ``user``; remove placement groups nobody uses any more (not detached ones)."""
        unused = []
        for pg_id in pg_ids:
            users = self._pg_users.get(pg_id)
            if users is None:
                continue
            users.discard(user)
            if not users:
                del self._pg_users[pg_id]
                unused.append(pg_id)
        if not unused:
            return
        for pool in list(self._pools):
            if pool.pgs is not None and not pool.detached and any(pg.id in unused for pg in pool.pgs):
                pool.pgs = None
        for pg_id in unused:
            with contextlib.suppress(Exception):
                await self.scheduler.remove_placement_group(pg_id)

    async def cluster_state(self):
        """The scheduler's ClusterState."""
        return await self.scheduler.cluster_state()

    # ---- teardown ---------------------------------------------------------------------

    def close(self) -> None:
        """Shut down groups, close the session, stop the embedded services and the loop."""
        if self._closed:
            return
        for group in list(self._groups):
            with contextlib.suppress(Exception):
                group.shutdown()
        with contextlib.suppress(Exception):
            self.run(self._close_async(), timeout=30, what="shutdown")
        self._closed = True
        self._loop_thread.stop()
        for proc in reversed(self.processes):
            _stop_process(proc)
        if self.gc_frozen:
            self.gc_frozen = False
            gcfreeze.unfreeze()

    async def _close_async(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self.log_to_driver is not None:
            await self.log_to_driver.close()
        for client in self._fetch_clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        with contextlib.suppress(Exception):
            await self.objects.close()
        if self.scheduler is not None:
            if self.session_id:
                with contextlib.suppress(Exception):
                    await self.scheduler.close_session(self.session_id)
            with contextlib.suppress(Exception):
                await self.scheduler.close()


async def _wait_nodes(runtime: Runtime, timeout: float = STARTUP_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        state = await runtime.scheduler.cluster_state()
        if state.nodes:
            return
        if time.monotonic() > deadline:
            raise DeadlineExceededError(f"no node registered with {runtime.address} within {timeout:g}s")
        await asyncio.sleep(0.05)


def init(address: str | None = None, token: str | None = None, *, num_gpus: int | None = None,
         num_cpus: float | None = None, call_timeout: float | None = None,
         log_dir: str | None = None, ignore_reinit_error: bool = True, tls: Any = None, resources: dict | None = None,
         session_lease: float | None = None, log_to_driver: bool | None = None) -> Runtime:
    """Connect this process to a Podium cluster (``ray.init``).

    ``address`` ("host:port" of a scheduler, else ``PODIUM_ADDRESS``) joins a running cluster
    with ``token`` (else ``PODIUM_TOKEN``, else the token file). Without one, an embedded
    scheduler and node agent start on 127.0.0.1 (``num_gpus`` fake GPUs; by default the real
    GPUs NVML finds, or 8 fake ones when there are none; ``num_cpus`` logical CPUs; ``resources``
    custom ones) and stop at :func:`shutdown` or process exit. ``call_timeout`` is the default deadline of every
    blocking call (``PODIUM_CALL_TIMEOUT``; by default none: a call waits while its worker
    lives, and fails within seconds when it dies or hangs). ``tls`` (a
    :class:`podium.auth.TlsConfig`, else ``PODIUM_TLS_CERT``/``PODIUM_TLS_KEY``/``PODIUM_TLS_CA``)
    makes every connection mutual TLS; an embedded cluster then serves with the same files.
    ``session_lease`` (``PODIUM_SESSION_LEASE``, else the scheduler's default) is how long
    the scheduler keeps this controller's non-detached placement groups and workers after
    its keep-alives stop (the process died without :func:`shutdown`).
    ``log_to_driver`` (``PODIUM_LOG_TO_DRIVER``, default on) prints what workers write to
    this process's stdout/stderr, each line prefixed with role, rank and node.
    A second ``init()`` returns the running runtime. Until :func:`shutdown`, the objects alive
    at ``init()`` (torch and the other imports) are frozen out of the garbage collector's
    scans (:mod:`podium.controller.session.gcfreeze`; ``PODIUM_GC_FREEZE=0`` turns that off).
    """
    global _runtime
    with _runtime_lock:
        if _runtime is not None:
            if not ignore_reinit_error:
                raise FailedPreconditionError("podium.controller.init() was already called")
            return _runtime
        call_timeout = parse_call_timeout(call_timeout, os.environ.get("PODIUM_CALL_TIMEOUT"))
        # A worker Podium started (an actor that calls other actors, a borrowed handle's first
        # use) joins its own cluster, whose scheduler its agent named; never one of its own.
        in_worker = os.environ.get("PODIUM_SCHEDULER") if os.environ.get("PODIUM_WORKER_ID") else None
        address = address or os.environ.get("PODIUM_ADDRESS") or in_worker or None
        if tls is None:
            from podium.auth import TlsConfig
            tls = TlsConfig.from_paths(os.environ.get("PODIUM_TLS_CERT"), os.environ.get("PODIUM_TLS_KEY"),
                                       os.environ.get("PODIUM_TLS_CA"))
        from podium.process import raise_fd_limit
        raise_fd_limit()  # the controller holds a connection or two per worker
        processes: list[subprocess.Popen] = []
        if address:
            from podium.auth import resolve_token
            token = resolve_token(token)
        else:
            address, token, processes, log_dir = _start_embedded(num_gpus, num_cpus, log_dir, tls, resources)
        if session_lease is None:
            session_lease = float(os.environ.get("PODIUM_SESSION_LEASE") or 0)
        runtime = Runtime(address=address, token=token, call_timeout=call_timeout,
                          processes=processes, log_dir=log_dir, tls=tls, session_lease=session_lease)
        from podium.controller.session.logdriver import LogToDriver, log_to_driver_enabled
        if log_to_driver_enabled(log_to_driver):
            runtime.log_to_driver = LogToDriver(token, tls)
        try:
            runtime.run(runtime._open(), timeout=STARTUP_TIMEOUT, what="OpenSession")
            runtime.run(_wait_nodes(runtime), timeout=STARTUP_TIMEOUT + 5, what="waiting for nodes")
        except BaseException:
            runtime.close()
            raise
        from podium.refs import get_resolver, set_resolver
        try:
            previous = get_resolver()
        except FailedPreconditionError:  # no worker host in this process
            previous = None
        set_resolver(Resolver(runtime, beside=previous))
        _runtime = runtime
        _register_atexit()
        runtime.gc_frozen = gcfreeze.freeze()
        return runtime


_atexit_registered = False


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(shutdown)
        _atexit_registered = True


def shutdown() -> None:
    """Tear down every WorkerGroup of this process, close the session and stop an embedded
    cluster. Safe to call twice; ``init()`` may be called again afterwards."""
    global _runtime
    with _runtime_lock:
        runtime, _runtime = _runtime, None
    if runtime is None:
        return
    try:
        runtime.close()
    finally:
        from podium.refs import get_resolver, set_resolver
        from podium.transport.shmstage import STAGE

        STAGE.close()  # no staged segment's file outlives the groups
        with contextlib.suppress(Exception):
            resolver = get_resolver()
            if isinstance(resolver, Resolver):
                set_resolver(resolver.beside)


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _runtime is not None


def get_runtime(auto_init: bool = True) -> Runtime:
    """The runtime of this process; like Ray, the first use calls :func:`init` if needed."""
    if _runtime is None:
        if not auto_init:
            raise FailedPreconditionError("podium.controller.init() has not been called")
        return init()
    return _runtime

