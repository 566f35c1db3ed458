"""What ``podium node`` takes: :class:`AgentConfig` and its command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
from typing import Sequence

from podium import errors
from podium.auth import TlsConfig
from podium.resources import parse_custom_resources
from podium.worker.agent.gpus import DEFAULT_FAKE_MEMORY, GpuProvider, parse_size

__all__ = ["AgentConfig", "build_parser", "config_from_args"]


@dataclasses.dataclass
class AgentConfig:
    """Everything ``podium node`` takes on its command line."""

    #: Scheduler address "host:port".
    scheduler: str
    #: Node address: where the agent serves and what it registers (127.0.0.2, ...).
    host: str = "127.0.0.1"
    #: Address to register instead of ``host`` (needed when ``host`` is 0.0.0.0, e.g. in a container).
    advertise_address: str = ""
    #: Agent gRPC port (0: any free one).
    port: int = 0
    #: Node id (default "<hostname>-<host>").
    node_id: str = ""
    #: CPUs offered to bundles (default: os.cpu_count()).
    cpus: float | None = None
    #: Custom resources offered to bundles (``{"nvlink_domain_0": 1}``); ``memory`` (bytes)
    #: defaults to the machine's physical memory.
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Fake this many GPUs (None: ask NVML).
    fake_gpus: int | None = None
    #: Memory of each fake GPU in bytes.
    fake_gpu_memory: int = DEFAULT_FAKE_MEMORY
    #: Where worker logs go (default ~/.podium/logs/<node-id>).
    log_dir: str | None = None
    #: Write {"port", "pid", "node_id", "address"} here once serving.
    port_file: str | None = None
    #: Cluster token (default: resolved as podium.auth.resolve_token says). Never in repr (logs).
    token: str | None = dataclasses.field(default=None, repr=False)
    #: File holding the cluster token.
    token_file: str | None = None
    #: Mutual TLS for the agent's server and its calls to the scheduler.
    tls: TlsConfig | None = None
    #: Default seconds between SIGTERM and SIGKILL.
    stop_grace: float = 5.0
    #: Command that starts a worker ("--ready-fd N" is appended); None: python -m podium.worker.host.
    worker_command: Sequence[str] | None = None
    #: Informational labels sent with the registration.
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Port of the Prometheus /metrics endpoint on ``host`` (None: no endpoint; 0: any free one).
    metrics_port: int | None = None
    #: GPU provider to use instead of detecting one (tests inject patched NVML here).
    provider: GpuProvider | None = None


def build_parser() -> argparse.ArgumentParser:
    """The ``podium node`` command line."""
    parser = argparse.ArgumentParser(prog="podium node", description="Run a Podium node agent.")
    parser.add_argument("--scheduler", default=os.environ.get("PODIUM_ADDRESS") or None,
                        required=not os.environ.get("PODIUM_ADDRESS"),
                        help="scheduler address HOST:PORT (default: $PODIUM_ADDRESS)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="node address to serve on and register (default 127.0.0.1)")
    parser.add_argument("--advertise-address", default="",
                        help="address to register when --host is not reachable as such "
                             "(e.g. --host 0.0.0.0 in a container; default: --host)")
    parser.add_argument("--port", type=int, default=0, help="agent gRPC port (default: any free)")
    parser.add_argument("--node-id", default="", help="node id (default <hostname>-<node address>)")
    parser.add_argument("--cpus", type=float, default=None, help="CPUs offered (default: all)")
    parser.add_argument("--resources", default=None, metavar="JSON",
                        help='custom resources offered, e.g. \'{"nvlink_domain_0": 1}\' (memory in bytes: '
                             "default the machine's memory)")
    parser.add_argument("--fake-gpus", type=int, default=None,
                        help="pretend to have N GPUs instead of asking NVML")
    parser.add_argument("--fake-gpu-memory", default="80GiB", help="memory per fake GPU (80GiB)")
    parser.add_argument("--log-dir", default=None,
                        help="worker log directory (default ~/.podium/logs/<node-id>)")
    parser.add_argument("--port-file", default=None,
                        help='write {"port", "pid", "node_id", "address", "metrics_port"} as JSON here once serving')
    parser.add_argument("--token-file", default=None, help="file with the cluster token")
    parser.add_argument("--tls-cert", default=None)
    parser.add_argument("--tls-key", default=None)
    parser.add_argument("--tls-ca", default=None)
    parser.add_argument("--stop-grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when stopping workers (5)")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                        help="informational node label (repeatable)")
    parser.add_argument("--worker-command", default=None,
                        help="advanced: command starting a worker, e.g. a wrapper; "
                             '"--ready-fd N" is appended (default: python -m podium.worker.host)')
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics (token required) on --host at this port "
                             "(0: any free one, written to --port-file; default: none)")
    parser.add_argument("--log-level", default="INFO")
    return parser


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """AgentConfig from parsed ``podium node`` arguments (InvalidArgumentError on bad ones)."""
    labels = {}
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise errors.InvalidArgumentError(f"--label wants KEY=VALUE, got {item!r}")
        labels[key] = value
    resources = parse_resources_arg(args.resources)
    if args.stop_grace < 0:
        raise errors.InvalidArgumentError(f"--stop-grace must be >= 0, got {args.stop_grace}")
    return AgentConfig(
        scheduler=args.scheduler, host=args.host, advertise_address=args.advertise_address,
        port=args.port, node_id=args.node_id,
        cpus=args.cpus, resources=resources, fake_gpus=args.fake_gpus, fake_gpu_memory=parse_size(args.fake_gpu_memory),
        log_dir=args.log_dir, port_file=args.port_file, token_file=args.token_file,
        tls=TlsConfig.from_paths(args.tls_cert, args.tls_key, args.tls_ca),
        stop_grace=args.stop_grace, labels=labels, metrics_port=args.metrics_port,
        worker_command=shlex.split(args.worker_command) if args.worker_command else None)


def parse_resources_arg(text: str | None) -> dict[str, float]:
    """``--resources '{"name": amount}'`` as a dict (InvalidArgumentError naming what is wrong)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise errors.InvalidArgumentError(f"--resources must be a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict) or any(k in ("CPU", "GPU") for k in value):
        raise errors.InvalidArgumentError(f"--resources must be a JSON object of custom resources (CPUs and "
                                          f"GPUs are --cpus and --fake-gpus), got {text!r}")
    try:
        parse_custom_resources(value, what="--resources")
    except errors.InvalidSpecError as exc:
        raise errors.InvalidArgumentError(exc.message) from None
    return {k: float(v) for k, v in value.items()}
