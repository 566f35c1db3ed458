"""Health probes for container health checks: exit 0 when a service answers, 1 when not.

    python -m podium.cli.healthprobe http://127.0.0.1:8265/healthz   # HTTP 200 (the scheduler)
    python -m podium.cli.healthprobe grpc 127.0.0.1:50052             # grpc.health.v1 SERVING (any service)

Images need no curl for this, and the gRPC form presents the cluster token
(``PODIUM_TOKEN`` or the token file) and ``PODIUM_TLS_CERT/KEY/CA`` when set,
because every Podium gRPC service, health included, requires them. Light: no
torch, no event loop; one attempt with a deadline, so a hung service fails the check.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

DEFAULT_TIMEOUT = 3.0


def probe_http(url: str, timeout: float = DEFAULT_TIMEOUT) -> str | None:
    """GET ``url``; None when it answers 200, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def probe_grpc(address: str, timeout: float = DEFAULT_TIMEOUT, service: str = "") -> str | None:
    """Ask ``address``'s grpc.health.v1 service; None when SERVING, else why not."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from podium.auth import TOKEN_METADATA_KEY, TlsConfig, bearer, resolve_token

    tls = TlsConfig.from_paths(os.environ.get("PODIUM_TLS_CERT"), os.environ.get("PODIUM_TLS_KEY"),
                               os.environ.get("PODIUM_TLS_CA"))
    try:
        token = resolve_token()
    except Exception as exc:  # noqa: BLE001 - any failure is "not healthy", said in one line
        return f"no cluster token: {exc}"
    if tls is not None:
        options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
        channel = grpc.secure_channel(address, tls.channel_credentials(), options=options)
    else:
        channel = grpc.insecure_channel(address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout,
                           metadata=((TOKEN_METADATA_KEY, bearer(token)),))
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    finally:
        channel.close()
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m podium.cli.healthprobe URL`` or ``python -m podium.cli.healthprobe grpc HOST:PORT``."""
    parser = argparse.ArgumentParser(prog="python -m podium.cli.healthprobe", description=__doc__.split("\n")[0])
    parser.add_argument("target", nargs="+", help="http(s)://URL, or: grpc HOST:PORT")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds (3)")
    args = parser.parse_args(argv)
    if args.target[0] == "grpc" and len(args.target) == 2:
        problem = probe_grpc(args.target[1], args.timeout)
    elif len(args.target) == 1 and args.target[0].startswith(("http://", "https://")):
        problem = probe_http(args.target[0], args.timeout)
    else:
        parser.error("give an http(s):// URL, or: grpc HOST:PORT")
    if problem:
        print(f"unhealthy: {' '.join(args.target)}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
