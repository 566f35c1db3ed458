"""``podium scheduler``: run the Scheduler gRPC service and its HTTP endpoints.

:func:`main` is the command line; :func:`run_scheduler` starts the same thing
inside a running event loop (integration tests, the embedded cluster) and returns
a :class:`RunningScheduler` to stop it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass

import grpc

from podium import errors, process
from podium.auth import TlsConfig, resolve_token
from podium.private import write_private_atomic
from podium.rpc import bind, make_server, start_server, use_uvloop
from podium.scheduler.http import HttpServer
from podium.scheduler.jobnodes import JobNodes
from podium.scheduler import packageserve
from podium.scheduler.jobs import JobManager
from podium.scheduler.records import DEFAULT_NODE_LEASE
from podium.scheduler.service import SchedulerConfig, SchedulerService
from podium.scheduler.store import Store
from podium.v1 import scheduler_pb2_grpc

log = logging.getLogger("podium.scheduler")

__all__ = ["RunningScheduler", "run_scheduler", "main", "parse_args", "write_port_file"]

DEFAULT_STATE = os.path.join("~", ".podium", "scheduler.db")
#: The GIL switch interval of a ``podium scheduler`` process (see :func:`main`).
SWITCH_INTERVAL_SECONDS = 0.0005


@dataclass
class RunningScheduler:
    """A started scheduler: its service, the bound ports, and how to stop it."""

    service: SchedulerService
    grpc_server: grpc.aio.Server
    http: HttpServer
    port: int
    http_port: int
    host: str
    #: Submitted jobs (podium.scheduler.jobs) and their folder if it is a temporary one.
    jobs: JobManager | None = None
    jobs_tmp: str = ""

    @property
    def address(self) -> str:
        """``host:port`` of the gRPC service."""
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP endpoints."""
        scheme = "https" if self.service.config.tls else "http"
        return f"{scheme}://{self.host}:{self.http_port}"

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving (in-flight RPCs get ``grace`` seconds), then close the state."""
        self.http.ready = False
        if self.jobs is not None:
            await self.jobs.close()  # SIGTERM, then SIGKILL, to running drivers
        await self.http.stop()
        await self.service.end_streams()
        await self.grpc_server.stop(grace)
        await self.service.close()
        if self.jobs_tmp:
            shutil.rmtree(self.jobs_tmp, ignore_errors=True)


def _jobs_folder(config: SchedulerConfig) -> tuple[str, str]:
    """(jobs folder, the same if it is temporary): ``--jobs-dir``, else ``jobs/`` beside the
    state file, else (an in-memory state) a temporary folder removed on stop."""
    if config.jobs_dir:
        return os.path.expanduser(config.jobs_dir), ""
    if config.state != ":memory:":
        return os.path.join(os.path.dirname(os.path.abspath(os.path.expanduser(config.state))), "jobs"), ""
    tmp = tempfile.mkdtemp(prefix="podium-jobs-")
    return tmp, tmp


def _connect_host(host: str) -> str:
    """An address a process on this machine reaches a server bound to ``host`` at."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


async def run_scheduler(config: SchedulerConfig) -> RunningScheduler:
    """Load the state, start gRPC and HTTP (port 0 picks free ports), return the handle."""
    store = Store(config.state, fresh=config.fresh_state)
    if store.set_aside:
        log.warning("--fresh-state: the previous state file is kept as %s; starting empty",
                    store.set_aside)
    service = SchedulerService(config, store)
    server, health = make_server(config.token)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server)
    packages = packageserve.add_to_server(server)  # runtime_env package URIs, for the nodes
    port = bind(server, config.host, config.port, config.tls)
    await start_server(server, health)
    service.start()
    folder, jobs_tmp = _jobs_folder(config)
    jobs = JobManager(folder, store, service.close_sessions, token=config.token, tls=config.tls,
                      nodes=JobNodes(service))
    packages.store = jobs.packages
    http = HttpServer(service, config, jobs)
    try:
        host = _connect_host(config.host)
        await jobs.start(f"[{host}]:{port}" if ":" in host else f"{host}:{port}", host)
        http_port = await http.start(config.host, config.http_port)
    except BaseException:
        await server.stop(0)
        await service.close()
        if jobs_tmp:
            shutil.rmtree(jobs_tmp, ignore_errors=True)
        raise
    http.ready = True
    log.info("scheduler %s serving gRPC on %s:%d, HTTP on %d, state %s",
             service.scheduler_id, config.host, port, http_port, config.state)
    return RunningScheduler(service=service, grpc_server=server, http=http, port=port,
                            http_port=http_port, host=config.host, jobs=jobs, jobs_tmp=jobs_tmp)


def write_port_file(path: str, payload: dict) -> None:
    """Write JSON atomically (tmp file + rename), so a reader never sees half of it."""
    write_private_atomic(path, json.dumps(payload))  # 0600, like every file Podium makes


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The ``podium scheduler`` flags."""
    p = argparse.ArgumentParser(prog="podium scheduler", description="Run the Podium scheduler.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    p.add_argument("--http-port", type=int, default=8265, help="HTTP port (0: any free port)")
    p.add_argument("--state", default=DEFAULT_STATE,
                   help="SQLite state file (default ~/.podium/scheduler.db; ':memory:' keeps none)")
    p.add_argument("--jobs-dir", default="",
                   help="folder of submitted jobs' packages, logs and working dirs "
                        "(default: jobs/ beside the --state file)")
    p.add_argument("--fresh-state", action="store_true",
                   help="start with an empty state: an existing --state file (say, one the "
                        "scheduler refused as damaged) is renamed to FILE.bad-<time>, not deleted")
    p.add_argument("--token-file", default=None,
                   help="cluster token file (created 0600 if missing; PODIUM_TOKEN wins)")
    p.add_argument("--node-lease", type=float, default=DEFAULT_NODE_LEASE,
                   help="seconds without heartbeat before a node is dead (its agent fences "
                        "itself lease - max(interval, lease/5) after its last answered one)")
    p.add_argument("--heartbeat-interval", type=float, default=2.0,
                   help="heartbeat interval told to node agents")
    p.add_argument("--session-lease", type=float, default=30.0,
                   help="default controller session lease in seconds")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--tls-ca")
    p.add_argument("--port-file", default=None,
                   help='write {"port", "http_port", "pid"} as JSON here once serving')
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    for flag in ("node_lease", "heartbeat_interval", "session_lease"):
        value = getattr(args, flag)
        if not value > 0:
            p.error(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    return args


async def _serve(config: SchedulerConfig, port_file: str | None) -> None:
    running = await run_scheduler(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if port_file:
        write_port_file(port_file, {"port": running.port, "http_port": running.http_port,
                                    "pid": os.getpid()})
    await stop.wait()
    log.info("stopping")
    await running.stop()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``podium scheduler``; returns the exit status."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    process.raise_fd_limit()
    try:
        tls = TlsConfig.from_paths(args.tls_cert, args.tls_key, args.tls_ca)
        token = resolve_token(token_file=args.token_file, create=True)
    except errors.PodiumError as exc:
        print(f"podium scheduler: {exc}", file=sys.stderr)
        return 2
    config = SchedulerConfig(token=token, host=args.host, port=args.port, http_port=args.http_port,
                             state=args.state, fresh_state=args.fresh_state, jobs_dir=args.jobs_dir,
                             node_lease=args.node_lease,
                             heartbeat_interval=args.heartbeat_interval,
                             session_lease=args.session_lease, tls=tls)
    use_uvloop()
    # grpc.aio hands every finished network event from its poller thread to the loop
    # thread, and that thread waits for the GIL: with the default 5 ms switch interval a
    # loop busy placing groups hands them over in 5 ms turns. A short interval costs little
    # in a process whose only other threads are grpc's and short placement jobs; measured
    # with bench.scheduler_scale (bench/HISTORY.md, "Scale"), steady heartbeats' p99 came
    # nearer the 20 ms goal and creations got a little faster, within that bench's noise.
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    try:
        asyncio.run(_serve(config, args.port_file))
    except errors.PodiumError as exc:
        print(f"podium scheduler: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
