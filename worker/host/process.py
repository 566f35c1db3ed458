"""The worker process: starting a host (in-process for tests, or as ``python -m podium.worker.host``).

The node agent starts ``python -m podium.worker.host --ready-fd N`` with the worker environment
(RANK, WORLD_SIZE, PODIUM_WORKER_ID, PODIUM_NODE_ADDRESS, PODIUM_TOKEN, PODIUM_TLS_CERT/KEY/CA,
...). The process binds ``PODIUM_NODE_ADDRESS:0``, writes one JSON line ``{"port": <int>}`` to
the ready fd, closes it and serves the ``podium.v1.Worker`` service (and, without TLS, the raw
call socket) until SIGTERM or a Shutdown RPC. Tests run a host in-process with :func:`start_host`.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import grpc

from podium import codec, errors, process, refs, rpc
from podium.auth import TlsConfig, resolve_token
from podium.v1 import worker_pb2, worker_pb2_grpc
from podium.worker import masterstore
from podium.worker.host import gpucap
from podium.worker.host.callstream import CallStream
from podium.worker.host.config import HostConfig
from podium.worker.host.runtime import HostRuntime
from podium.worker.host.borrowerwatch import BorrowerWatch
from podium.worker.host.servicer import WorkerServicer

__all__ = ["HostResolver", "RunningHost", "start_host", "current_host", "main"]

log = logging.getLogger("podium.worker.host")


class HostResolver:
    """Fetches refs for code in this worker: from its own store, or from peers directly."""

    def __init__(self, host: HostRuntime, token: str, tls: TlsConfig | None = None) -> None:
        self._host = host
        self._token = token
        self._tls = tls
        self._loop = asyncio.get_running_loop()
        self._clients: dict[str, Any] = {}

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The host's loop, which owns the peer clients."""
        return self._loop

    def owns(self, address: str) -> bool:
        """Whether ``address`` is this worker's own (its values are held here)."""
        return address == self._host.address

    async def send_borrows(self, owner: str, borrow: list[str], unborrow: list[str]) -> None:
        """Count borrows of ``owner``'s values, and give borrows back (podium.borrows)."""
        await self._client(owner).channel.release([], borrow=borrow, unborrow=unborrow, borrower=self.borrower)

    @property
    def borrower(self) -> str:
        """This process as a borrower: the host's address, which its owners watch."""
        return self._host.address

    def _client(self, address: str, rank: int = -1, worker_id: str = "") -> Any:
        client = self._clients.get(address)
        if client is None:
            from podium.worker.caller.client import WorkerClient

            client = WorkerClient(address, self._token, rank=rank, worker_id=worker_id, tls=self._tls)
            self._clients[address] = client
        return client

    async def fetch(self, ref: refs.ObjectRef, rows: tuple[int, int] | None = None) -> Any:
        """The value of ``ref`` (or rows of it); a copy, so callers may mutate it. Awaited on
        another loop (a thread of the user's own), it runs on the host's."""
        if asyncio.get_running_loop() is not self._loop:
            return await refs.on_loop(self._loop, self.fetch(ref, rows))
        host = self._host
        if ref.owner_address == host.address:
            _, encoded = host.fetch_value(ref.object_id, rows)
            return codec.decode(bytearray(b"".join(encoded.to_segments())))
        client = self._client(ref.owner_address, ref.owner_rank, ref.worker_id)
        try:
            value = await client.fetch(ref, rows)
        except Exception as exc:  # noqa: BLE001 - an owner gone or a released value: ObjectLostError
            raise refs.lost_error(ref, exc) from None
        host.stats["fetches_made"] += 1
        host.stats["bytes_fetched"] += client.last_fetch_bytes
        return value

    def run_sync(self, coro, timeout: float | None) -> Any:
        """Run ``coro`` on the host's loop from another thread (the execution thread)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            coro.close()
            raise errors.FailedPreconditionError(
                "a blocking .get() was called on the worker's event loop (inside an async "
                "method): use 'await future.aget()' there")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise errors.DeadlineExceededError(f"fetching refs took longer than {timeout} s") from None

    async def close(self) -> None:
        """Close the peer clients."""
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()


# --------------------------------------------------------------------------- running


_current: HostRuntime | None = None


def current_host() -> HostRuntime | None:
    """The runtime of the host running in this process (None outside a worker)."""
    return _current


@dataclasses.dataclass
class RunningHost:
    """A started worker host: its server, runtime and port."""

    server: grpc.aio.Server
    runtime: HostRuntime
    resolver: HostResolver
    port: int
    host: str
    #: The raw call socket's server (podium.transport.callsocket), None where there is none (TLS).
    call_server: Any = None

    @property
    def address(self) -> str:
        """"host:port" clients connect to."""
        return self.runtime.address

    async def wait_stopping(self) -> None:
        """Return once SIGTERM or a Shutdown RPC asked this host to stop."""
        await self.runtime.stopping.wait()

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving (in-flight RPCs get ``grace`` seconds) and drop held results."""
        global _current
        if self.call_server is not None:
            self.call_server.close()  # no new connections
            for conn in list(self.runtime.raw_connections):
                conn.close()  # and the open ones end, as the gRPC server's streams do
        await self.server.stop(grace)
        await self.resolver.close()
        self.runtime.close()
        if refs._resolver is self.resolver:
            refs.set_resolver(None)
        if _current is self.runtime:
            _current = None


async def start_host(address: str = "127.0.0.1", token: str | None = None,
                     env: Mapping[str, str] | None = None, *, port: int = 0,
                     tls: TlsConfig | None = None) -> RunningHost:
    """Start a worker host in this process's running loop, bound on ``address:port``.

    ``env`` supplies RANK, WORLD_SIZE, PODIUM_WORKER_ID and the byte limits
    (default: os.environ); ``token`` defaults to the cluster token lookup.
    Installs the host's ref resolver process-wide.
    """
    global _current
    token = resolve_token(token)
    config = HostConfig.from_env(env, address=address)
    # The opt-in GPU memory cap goes on before any payload is decoded or user code runs.
    cap = gpucap.apply_from_env(os.environ if env is None else env)
    runtime = HostRuntime(config)
    runtime.stats.update(cap.stats())
    server, health = rpc.make_server(token)
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(runtime), server)
    bound = rpc.bind(server, address, port, tls)
    runtime.address = f"[{address}]:{bound}" if ":" in address else f"{address}:{bound}"
    await rpc.start_server(server, health)
    call_server = None
    if os.environ.get("PODIUM_RAW_CALLS", "1") != "0":
        # The fast path of the Calls stream (podium.transport.callsocket), mutual TLS under TLS.
        from podium.transport import callsocket

        def on_connection(conn: Any) -> None:
            runtime.raw_connections.add(conn)
            task = asyncio.get_running_loop().create_task(CallStream(runtime, conn).run())
            def ended(t: asyncio.Task) -> None:
                conn.close()
                runtime.raw_connections.discard(conn)
                if not t.cancelled():
                    t.exception()  # retrieved: a failed stream is not "never retrieved"

            task.add_done_callback(ended)

        call_server, runtime.call_port = await callsocket.serve(
            address, token, worker_pb2.CallFrame.FromString, on_connection,
            max_bulk=runtime.config.max_payload_bytes,
            ssl_context=tls.ssl_context(server=True) if tls is not None else None)
    resolver = HostResolver(runtime, token, tls)
    runtime.borrower_watch = BorrowerWatch(runtime.held, token, tls)
    refs.set_resolver(resolver)
    _current = runtime
    return RunningHost(server=server, runtime=runtime, resolver=resolver, port=bound, host=address,
                       call_server=call_server)


def _write_ready(fd: int, port: int) -> None:
    line: dict[str, Any] = {"port": port}
    cap = gpucap.current()
    if cap.requested:  # the agent forwards it to the scheduler (/v1/placement)
        line["gpu_memory_cap"] = cap.ready_fields()
    data = (json.dumps(line) + "\n").encode()
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


async def _serve(args: argparse.Namespace) -> int:
    address = args.address or os.environ.get("PODIUM_NODE_ADDRESS") or "127.0.0.1"
    # The agent passes its TLS files (podium.worker.agent.spawner.worker_env): with them this
    # worker serves mutual TLS and fetches from its peers over it.
    tls = TlsConfig.from_paths(os.environ.get("PODIUM_TLS_CERT"), os.environ.get("PODIUM_TLS_KEY"),
                               os.environ.get("PODIUM_TLS_CA"))
    running = await start_host(address, os.environ.get("PODIUM_TOKEN") or None, os.environ, tls=tls)
    # Start-up phases, epoch seconds, for whoever measures cold start (the bench reads
    # PODIUM_*_AT): agent asked (SPAWN_REQUESTED), forked (FORKED, fork server only),
    # host code running (HOST_MAIN), gRPC and raw call servers up (SERVING).
    os.environ["PODIUM_SERVING_AT"] = repr(time.time())
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, running.runtime.stopping.set)
    log.info("worker %s rank %s serving on %s (pid %d)", running.runtime.config.worker_id or "-",
             running.runtime.config.rank, running.address, os.getpid())
    if args.ready_fd is not None:
        _write_ready(args.ready_fd, running.port)
    await running.wait_stopping()
    log.info("stopping")
    await running.stop(grace=1.0)
    return 0


def _exit_watchdog(seconds: float) -> None:
    # A user method stuck in native code keeps the execution thread alive and
    # would block interpreter exit forever; the agent must see us go.
    def run() -> None:
        time.sleep(seconds)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    threading.Thread(target=run, name="podium-exit-watchdog", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """Entry point of a worker process (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m podium.worker.host",
                                     description="Podium worker process (started by a node agent)")
    parser.add_argument("--ready-fd", type=int, default=None,
                        help='write {"port": N} to this fd once serving, then close it')
    parser.add_argument("--address", default=None,
                        help="address to bind (default: $PODIUM_NODE_ADDRESS or 127.0.0.1)")
    args = parser.parse_args(argv)
    os.environ["PODIUM_HOST_MAIN_AT"] = repr(time.time())
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank{os.environ.get('RANK', '?')} %(levelname)s "
                               f"%(name)s: %(message)s")
    process.raise_fd_limit()
    masterstore.take_listen_fd()  # rank 0: MASTER_PORT's socket, from the agent
    rpc.use_uvloop()
    try:
        code = asyncio.run(_serve(args))
    except errors.PodiumError as exc:  # bad token, address or limits: one clear line for the agent
        log.error("worker failed to start: %s: %s", type(exc).__name__, exc)
        return 2
    _exit_watchdog(5.0)
    return code
