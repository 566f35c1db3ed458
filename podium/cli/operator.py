"""The operator's commands: ``podium up``, ``down``, ``status``, ``logs`` and ``stack``.

``up``/``down`` manage a local cluster (see :mod:`podium.cli.localcluster`). ``status``,
``logs`` and ``stack`` work against that cluster, or any cluster with ``--address``
(else ``$PODIUM_ADDRESS``) and the usual token lookup.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from podium import errors

__all__ = ["main_up", "main_down", "main_status", "main_logs", "main_stack"]


def _dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=os.environ.get("PODIUM_LOCAL_DIR", "~/.podium/local"),
                        help="state directory of the local cluster (default ~/.podium/local, "
                             "or $PODIUM_LOCAL_DIR)")


def main_up(argv: list[str]) -> int:
    """``podium up``: start a local multi-node cluster and print how to use it."""
    from podium.cli import localcluster

    p = argparse.ArgumentParser(prog="podium up", description="Start a local multi-node cluster "
                                "(scheduler on 127.0.0.1, nodes on 127.0.0.2, 127.0.0.3, ...).")
    p.add_argument("--nodes", type=int, default=2, help="node agents to start (2)")
    p.add_argument("--gpus-per-node", type=int, default=4,
                   help="fake GPUs per node (4); -1: the real GPUs NVML finds")
    p.add_argument("--cpus-per-node", type=float, default=None, help="CPUs each node offers (all)")
    p.add_argument("--port", type=int, default=50051, help="scheduler gRPC port (0: any free)")
    p.add_argument("--http-port", type=int, default=8265, help="scheduler HTTP port (0: any free)")
    _dir_arg(p)
    args = p.parse_args(argv)
    try:
        cluster = localcluster.up(args.dir, nodes=args.nodes,
                                  gpus_per_node=None if args.gpus_per_node < 0 else args.gpus_per_node,
                                  cpus_per_node=args.cpus_per_node, port=args.port,
                                  http_port=args.http_port)
    except (errors.PodiumError, ValueError) as exc:
        print(f"podium up: {exc}", file=sys.stderr)
        return 1
    nodes = ", ".join(n.address for n in cluster.nodes)
    print(f"podium cluster up: scheduler {cluster.address}, {len(cluster.nodes)} nodes ({nodes})\n"
          f"  state:     {cluster.dir}\n"
          f"  dashboard: {cluster.http_url}/#token=$(cat {cluster.token_file})\n"
          f"  use it:    export PODIUM_ADDRESS={cluster.address} PODIUM_TOKEN_FILE={cluster.token_file}\n"
          f"             (or init(address=\"{cluster.address}\") in your script)\n"
          f"  metrics:   {', '.join(f'http://{r.address}:{r.metrics_port}/metrics' for r in cluster.processes())}"
          f" (Authorization: Bearer <token>)\n"
          f"  then:      podium status; podium logs WORKER --follow; podium down")
    return 0


def main_down(argv: list[str]) -> int:
    """``podium down``: stop the local cluster started by ``podium up``."""
    from podium.cli import localcluster

    p = argparse.ArgumentParser(prog="podium down", description="Stop the local cluster.")
    _dir_arg(p)
    p.add_argument("--grace", type=float, default=15.0,
                   help="seconds to wait after SIGTERM before SIGKILL (15)")
    args = p.parse_args(argv)
    cluster = localcluster.down(args.dir, grace=args.grace)
    if cluster is None:
        print(f"podium down: no local cluster recorded in {args.dir}", file=sys.stderr)
        return 0
    print(f"podium cluster down: stopped {len(cluster.nodes)} nodes and the scheduler at {cluster.address}")
    return 0


def _target(args: argparse.Namespace) -> tuple[str, str]:
    """(scheduler address, token) from --address/$PODIUM_ADDRESS, else the local cluster."""
    from podium.cli import localcluster
    from podium.auth import resolve_token

    address = args.address or os.environ.get("PODIUM_ADDRESS")
    if address:
        return address, resolve_token()
    cluster = localcluster.load(args.dir)
    if cluster is None:
        raise errors.FailedPreconditionError(
            f"no cluster: give --address HOST:PORT, set PODIUM_ADDRESS, or run `podium up` "
            f"(nothing recorded in {args.dir})")
    return cluster.address, os.environ.get("PODIUM_TOKEN") or cluster.token()


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None,
                   help="scheduler HOST:PORT (default $PODIUM_ADDRESS, else the local cluster)")
    _dir_arg(p)


async def _cluster_state(address: str, token: str):
    from podium.scheduler.client import SchedulerClient

    async with SchedulerClient(address, token, timeout=10.0) as client:
        return await client.cluster_state()


def main_status(argv: list[str]) -> int:
    """``podium status``: nodes, GPUs, placement groups and workers as tables."""
    from podium.cli.status_table import render_status

    p = argparse.ArgumentParser(prog="podium status", description="Show the cluster's state.")
    _target_args(p)
    p.add_argument("--all", action="store_true", help="include ended workers")
    args = p.parse_args(argv)
    try:
        address, token = _target(args)
        state = asyncio.run(_cluster_state(address, token))
    except errors.PodiumError as exc:
        print(f"podium status: {exc}", file=sys.stderr)
        return 1
    print(render_status(state, all_workers=args.all))
    return 0


async def _logs(address: str, token: str, worker: str, tail: int, follow: bool) -> None:
    from podium.agentlogs import agent_address, find_worker, tail_log

    state = await _cluster_state(address, token)
    info = find_worker(state, worker)
    async for line in tail_log(agent_address(state, info.node_id), token, info.id,
                               last_lines=tail, follow=follow):
        out = sys.stderr if line.stream == "stderr" else sys.stdout
        out.write(line.text + "\n")
        out.flush()


def main_logs(argv: list[str]) -> int:
    """``podium logs WORKER [--follow]``: a worker's output, read from its node agent."""
    p = argparse.ArgumentParser(prog="podium logs", description="Print a worker's stdout and stderr.")
    p.add_argument("worker", help="worker id or name (see `podium status`)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until it exits")
    p.add_argument("--tail", type=int, default=0, help="start with the last N lines of each stream (0: all)")
    _target_args(p)
    args = p.parse_args(argv)
    try:
        address, token = _target(args)
        asyncio.run(_logs(address, token, args.worker, args.tail, args.follow))
    except KeyboardInterrupt:
        return 130
    except errors.PodiumError as exc:
        print(f"podium logs: {exc}", file=sys.stderr)
        return 1
    return 0


async def _stacks(address: str, token: str, args: argparse.Namespace):
    from podium.workerstacks import collect

    state = await _cluster_state(address, token)
    return await collect(state, token, group=args.group, rank=args.rank, worker_id=args.worker,
                         timeout=args.timeout)


def main_stack(argv: list[str]) -> int:
    """``podium stack``: the Python stack of every thread of the selected live workers; a worker
    that cannot answer (stopped, stuck in native code) is named with its /proc state."""
    from podium.workerstacks import DEFAULT_TIMEOUT_SECONDS

    p = argparse.ArgumentParser(prog="podium stack", description="Print the Python stacks of live workers "
                                "(every thread), asked in parallel; silent ones with their /proc state.")
    p.add_argument("--group", default=None, help="only this group (its name prefix, as `podium status` shows)")
    p.add_argument("--rank", type=int, default=None, help="only this rank")
    p.add_argument("--worker", default=None, help="only this worker (id or name)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS,
                   help=f"seconds each worker may take to answer ({DEFAULT_TIMEOUT_SECONDS:g})")
    p.add_argument("--json", action="store_true", help="print JSON (as GET /v1/stacks answers)")
    _target_args(p)
    args = p.parse_args(argv)
    try:
        address, token = _target(args)
        report = asyncio.run(_stacks(address, token, args))
    except errors.PodiumError as exc:
        print(f"podium stack: {exc}", file=sys.stderr)
        return 1
    if args.json:
        import json

        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report)
    return 0
