"""One node agent inside a Slurm job step: what ``podium slurm`` starts on every node with ``srun``.

    srun --overlap --ntasks-per-node=1 python -m podium.cli.slurmnode --scheduler HOST:PORT ...

It is ``podium node`` with its settings taken from the allocation:

- the address it serves on and registers is the one this node routes to the scheduler
  from (so it works whatever the node's host name resolves to);
- the node id is Slurm's node name (``SLURMD_NODENAME``), labels name the job;
- the GPUs are those of the allocation (:func:`job_gpus`, :mod:`podium.worker.agent.gpufilter`):
  ``CUDA_VISIBLE_DEVICES`` as Slurm sets it for the step, also with ``--fake-gpus``;
- the cluster token comes from ``PODIUM_TOKEN`` (srun passes the launcher's environment).

It runs until SIGUSR2, SIGTERM or SIGINT, then stops its workers (SIGTERM, SIGKILL after
``--stop-grace``) and exits. SIGUSR2 is how ``podium slurm`` ends the step: srun forwards
it to every task as it is, whereas it turns a SIGTERM into SIGKILL (no time to stop the
workers). ``scancel`` sends SIGTERM to every task itself, which works too.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping

from podium import errors, rpc

__all__ = ["main", "route_address", "agent_argv", "default_cpus", "job_gpus"]

log = logging.getLogger("podium.slurm.node")


def route_address(host: str, port: int) -> str:
    """The local IP address this machine uses to reach ``host:port`` (no packet is sent:
    connecting a UDP socket only picks the route)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            return sock.getsockname()[0]
    except OSError as exc:
        raise errors.UnavailableError(f"no route from this node to the scheduler {host}:{port}: {exc}") from None


def split_address(address: str) -> tuple[str, int]:
    """("host", port) from "host:port" (InvalidArgumentError otherwise)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.InvalidArgumentError(f"--scheduler wants HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def agent_argv(args: argparse.Namespace, env: Mapping[str, str]) -> list[str]:
    """The ``podium node`` arguments for this node of the allocation."""
    host, port = split_address(args.scheduler)
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    argv = ["--scheduler", args.scheduler, "--host", route_address(host, port), "--port", "0",
            "--node-id", node, "--log-dir", os.path.join(args.log_dir, node),
            "--stop-grace", str(args.stop_grace),
            "--label", f"slurm_job_id={env.get('SLURM_JOB_ID', '')}", "--label", f"slurm_node={node}"]
    if args.cpus is not None:
        argv += ["--cpus", str(args.cpus)]
    if args.fake_gpus is not None:
        argv += ["--fake-gpus", str(args.fake_gpus)]
    return argv


def job_gpus(env: Mapping[str, str], every_gpu: bool = False) -> tuple[str, ...] | None:
    """The GPUs this step may use (None: every GPU NVML finds).

    ``CUDA_VISIBLE_DEVICES`` as Slurm's gres plugin sets it for the step, else
    ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS`` (the allocation's GPU indices). With none of
    them the job was given no GPU, and a shared node's GPUs belong to other jobs: offer
    none, unless ``every_gpu`` (nodes without gres/gpu, given whole; fake GPUs)."""
    from podium.worker.agent.gpufilter import parse_visible_devices

    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        if name in env:
            return parse_visible_devices(env[name])
    return None if every_gpu else ()


def default_cpus(gpus: int, env: Mapping[str, str]) -> float:
    """CPU slots to offer: the step's CPUs, and at least 16 per GPU. Bundle CPUs are
    colocation slots (verl asks ``max_colocate_count`` per bundle), not cores, as in
    ``podium up``."""
    cores = env.get("SLURM_CPUS_ON_NODE", "")
    count = int(cores) if cores.isdigit() else (os.cpu_count() or 1)
    return float(max(count, 16 * max(gpus, 1)))


async def _serve(config) -> int:
    from podium.worker.agent.service import run_agent

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    agent = await run_agent(config)
    print(f"podium slurm node: {agent.node_id} serving on {agent.node_address}:{agent.port} "
          f"with {len(agent.provider.gpus())} GPUs", flush=True)
    await stop.wait()
    log.info("node agent %s: shutting down", agent.node_id)
    await agent.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line ``podium slurm`` passes through ``srun``."""
    p = argparse.ArgumentParser(prog="python -m podium.cli.slurmnode",
                                description="Run a node agent inside a Slurm job step.")
    p.add_argument("--scheduler", required=True, help="scheduler HOST:PORT")
    p.add_argument("--log-dir", required=True, help="worker logs go to LOG_DIR/<node name>/")
    p.add_argument("--cpus", type=float, default=None,
                   help="CPU slots offered (default: the step's CPUs, at least 16 per GPU)")
    p.add_argument("--fake-gpus", type=int, default=None, help="pretend to have N GPUs")
    p.add_argument("--stop-grace", type=float, default=5.0, help="SIGTERM -> SIGKILL for workers (5 s)")
    p.add_argument("--all-gpus", action="store_true",
                   help="offer every GPU NVML finds when Slurm names none (no gres/gpu configured)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run this node's agent until SIGUSR2/SIGTERM/SIGINT; returns the exit status."""
    from podium.worker.agent.service import build_parser as node_parser, config_from_args
    from podium.worker.agent.gpufilter import VisibleGpus
    from podium.worker.agent.gpus import detect

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        node_args = node_parser().parse_args(agent_argv(args, dict(os.environ)))
        config = config_from_args(node_args)
        visible = job_gpus(dict(os.environ), every_gpu=args.all_gpus or config.fake_gpus is not None)
        provider = VisibleGpus(detect(config.fake_gpus, fake_memory_bytes=config.fake_gpu_memory,
                                      node_id=config.node_id), visible)
        config = dataclasses.replace(config, provider=provider,
                                     cpus=config.cpus or default_cpus(len(provider.gpus()), os.environ))
        rpc.use_uvloop()
        return asyncio.run(_serve(config))
    except errors.PodiumError as exc:
        print(f"podium slurm node: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
