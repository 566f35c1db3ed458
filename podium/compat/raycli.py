"""The ``ray`` command under ``podium run``: ``ray start``, ``ray status`` and ``ray stop`` on
Podium's own processes, for launchers that shell out to Ray's CLI (ROLL's).

* ``ray start --head [--port 6379] [--dashboard-port P] [--num-cpus N] [--node-ip-address IP]
  [--node-name NAME] [--block]`` starts a ``podium scheduler`` on that port and a ``podium
  node`` agent on this machine (Ray's head is a worker node too), as daemons; under ``podium
  run --num-cpus N --num-gpus M`` the agent offers N CPUs (unless ``--num-cpus`` is given) and M
  fake GPUs, as the embedded cluster would;
* ``ray start --address HOST:PORT [...]`` starts a ``podium node`` agent that joins that
  scheduler;
* ``ray status [--address HOST:PORT]`` prints ``podium status`` of the cluster (exit status 1
  when none answers, as Ray's);
* ``ray stop [--force] [-g GRACE]`` stops what ``ray start`` started on this machine (agents
  first; they stop their workers), then the scheduler.

What ``ray start`` started is recorded in ``$PODIUM_RAY_DIR`` (default ``~/.podium/ray``):
``cluster.json``, the logs and the scheduler's state. The cluster token is the usual one
(``PODIUM_TOKEN``, ``PODIUM_TOKEN_FILE`` or ``~/.podium/token``, created if missing), so
``ray.init(address=...)`` on this machine finds it; other machines need the same token.
A flag Podium cannot honour is refused with the Podium alternative; flags that cannot matter
on Podium (usage stats, the object store's size...) are accepted and listed in ``--help``.
``podium run`` puts the ``ray`` script of ``podium/compat/raybin`` first on ``PATH``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import socket
import sys
import time
from dataclasses import asdict

from podium.auth import resolve_token
from podium.cli.localcluster import ProcessRecord, _alive, _spawn, _stop_pids, _wait_file, _wait_nodes
from podium.private import private_dir, write_private_atomic

__all__ = ["main", "state_dir", "NO_EFFECT_FLAGS", "REFUSED_FLAGS"]

#: How long ``ray start`` waits for its processes to serve.
START_TIMEOUT = 60.0
#: ``ray start`` flags accepted with no effect, and why they cannot matter on Podium.
NO_EFFECT_FLAGS = {
    "--disable-usage-stats": "Podium collects no usage stats",
    "--include-dashboard": "the scheduler always serves its HTTP dashboard",
    "--dashboard-host": "the scheduler's HTTP port listens where its gRPC port does",
    "--object-store-memory": "Podium has no shared object store",
    "--temp-dir": "Podium's files go to $PODIUM_RAY_DIR",
    "--plasma-directory": "Podium has no shared object store",
    "--min-worker-port": "workers take any free port",
    "--max-worker-port": "workers take any free port",
    "--ray-client-server-port": "Podium has no Ray Client server: ray.init(address=...) joins directly",
    "--dashboard-agent-listen-port": "Podium runs no dashboard agent",
    "--metrics-export-port": "node agents serve /metrics on a port of their own",
}
#: ``ray start`` flags Podium cannot honour, and what to do instead.
REFUSED_FLAGS = {
    "--num-gpus": "the agent offers the GPUs NVML finds (`podium run --num-gpus N` or `podium node --fake-gpus N` "
                  "for tests)",
    "--resources": "num_cpus/num_gpus, or a placement group bundle",
    "--labels": "NodeAffinitySchedulingStrategy on the node's address",
    "--redis-password": "the cluster token (PODIUM_TOKEN)",
}


def state_dir() -> pathlib.Path:
    """Where ``ray start`` records what it started (``$PODIUM_RAY_DIR``, default ``~/.podium/ray``)."""
    return pathlib.Path(os.environ.get("PODIUM_RAY_DIR") or "~/.podium/ray").expanduser()


def _load() -> dict:
    try:
        return json.loads((state_dir() / "cluster.json").read_text())
    except FileNotFoundError:
        return {"address": "", "processes": []}


def _save(state: dict) -> None:
    private_dir(state_dir())
    write_private_atomic(state_dir() / "cluster.json", json.dumps(state, indent=1))


def _this_machine(towards: str) -> str:
    """The address this machine reaches ``towards`` from (loopback for a loopback peer)."""
    host = towards.rsplit(":", 1)[0]
    if host.startswith("127.") or host in ("localhost", ""):
        return "127.0.0.1"
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: this only picks the route
        return str(probe.getsockname()[0])
    return "127.0.0.1"


def _start_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ray start", description="Start Podium's scheduler and/or node agent.",
                                epilog="accepted with no effect: " + "; ".join(
                                    f"{k} ({v})" for k, v in NO_EFFECT_FLAGS.items()))
    p.add_argument("--head", action="store_true", help="start the scheduler and a node agent here")
    p.add_argument("--address", default=None, help="HOST:PORT of the scheduler a node agent joins")
    p.add_argument("--port", type=int, default=6379, help="the scheduler's gRPC port (--head)")
    p.add_argument("--dashboard-port", type=int, default=0, help="the scheduler's HTTP port (--head; 0: any)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs this node offers (default: all)")
    p.add_argument("--node-ip-address", default=None, help="the address this node serves on and registers")
    p.add_argument("--node-name", default=None, help="the node's id")
    p.add_argument("--block", action="store_true", help="stay in the foreground; stop everything on exit")
    for flag in NO_EFFECT_FLAGS:
        p.add_argument(flag, nargs="?", const=True, default=None, help=argparse.SUPPRESS)
    for flag in REFUSED_FLAGS:
        p.add_argument(flag, default=None, help=argparse.SUPPRESS)
    return p


def _start(argv: list[str]) -> int:
    args, unknown = _start_parser().parse_known_args(argv)
    if unknown:
        print(f"ray start: {' '.join(unknown)} not supported by Podium's ray command; on Podium use "
              "`podium scheduler` / `podium node` flags", file=sys.stderr)
        return 2
    for flag, alternative in REFUSED_FLAGS.items():
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            print(f"ray start {flag} is not supported by Podium: {alternative}", file=sys.stderr)
            return 2
    if args.head == bool(args.address):
        print("ray start: give --head (start a cluster) or --address HOST:PORT (join one)", file=sys.stderr)
        return 2
    state = _load()
    if args.head and any(p["role"] == "scheduler" and _alive(p["pid"]) for p in state["processes"]):
        print(f"ray start: a cluster started here already runs at {state['address']}; `ray stop` first",
              file=sys.stderr)
        return 1
    state["processes"] = [p for p in state["processes"] if _alive(p["pid"])]
    token = resolve_token(None, create=True)
    env = dict(os.environ, PODIUM_TOKEN=token, PYTHONUNBUFFERED="1")
    env.pop("PODIUM_TOKEN_FILE", None)
    root = state_dir()
    private_dir(root)
    cli = [sys.executable, "-m", "podium.cli"]
    deadline = time.monotonic() + START_TIMEOUT
    started: list[ProcessRecord] = []
    try:
        if args.head:
            ip = args.node_ip_address or "127.0.0.1"
            bind = ip if ip.startswith("127.") else "0.0.0.0"
            port_file, log = root / "scheduler.port.json", root / "logs" / "scheduler.log"
            port_file.unlink(missing_ok=True)
            sched = _spawn([*cli, "scheduler", "--host", bind, "--port", str(args.port), "--http-port",
                            str(args.dashboard_port), "--state", str(root / "scheduler.db"), "--fresh-state",
                            "--port-file", str(port_file)], log, env)
            started.append(ProcessRecord("scheduler", sched.pid, ip, args.port, str(log)))
            ports = _wait_file(port_file, sched, log, deadline)
            address = f"{ip}:{ports['port']}"
            http_url = f"http://{ip if bind != '0.0.0.0' else '127.0.0.1'}:{ports['http_port']}"
            state.update(address=address, http_url=http_url)
        else:
            address = args.address
            ip = args.node_ip_address or _this_machine(address)
        node_id = args.node_name or f"{socket.gethostname()}-{ip}-{os.getpid()}"
        port_file, log = root / f"node-{node_id}.port.json", root / "logs" / f"node-{node_id}.log"
        port_file.unlink(missing_ok=True)
        argv_node = [*cli, "node", "--scheduler", address, "--host", ip, "--node-id", node_id,
                     "--port-file", str(port_file), "--log-dir", str(root / "workers" / node_id)]
        # Under `podium run --num-cpus/--num-gpus` the node ray start starts has that size, as the
        # embedded cluster would (fake GPUs: ray start's own --num-gpus is refused above).
        cpus = args.num_cpus if args.num_cpus is not None else os.environ.get("PODIUM_RAY_NUM_CPUS")
        if cpus is not None:
            argv_node += ["--cpus", f"{float(cpus):g}"]
        if os.environ.get("PODIUM_RAY_NUM_GPUS"):
            argv_node += ["--fake-gpus", str(int(os.environ["PODIUM_RAY_NUM_GPUS"]))]
        node = _spawn(argv_node, log, env)
        started.append(ProcessRecord("node", node.pid, ip, 0, str(log)))
        _wait_file(port_file, node, log, deadline)
        if args.head:
            _wait_nodes(state["http_url"], token, 1, deadline)
    except Exception as exc:  # a daemon that did not start: stop the others, say why
        _stop_pids([p.pid for p in reversed(started)], grace=5.0)
        print(f"ray start: {exc}", file=sys.stderr)
        return 1
    state.setdefault("address", address)
    state["processes"] += [asdict(p) for p in started]
    _save(state)
    print(f"Podium started ({', '.join(p.role for p in started)}); the scheduler is at {address}.\n"
          f"Join from Python with ray.init(address={address!r}); stop with `ray stop`.")
    if args.block:
        return _block([p.pid for p in started])
    return 0


def _block(pids: list[int]) -> int:
    """``--block``: wait while the started processes live; stop them on SIGTERM/SIGINT."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        while not stopping and all(_alive(pid) for pid in pids):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    _stop_pids(list(reversed(pids)), grace=10.0)
    return 0


def _status(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ray status", description="Show the cluster's nodes and resources.")
    p.add_argument("--address", default=None, help="scheduler HOST:PORT (default: the cluster `ray start` started)")
    p.add_argument("-v", "--verbose", action="store_true", help="(every row is shown anyway)")
    args = p.parse_args(argv)
    address = args.address or os.environ.get("PODIUM_ADDRESS") or _load().get("address")
    if not address:
        print("ConnectionError: Could not find any running Podium cluster (Connection refused): "
              "`ray start --head` first, or give --address", file=sys.stderr)
        return 1
    from podium.cli.operator import main_status
    return main_status(["--address", address])


def _stop(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ray stop", description="Stop what `ray start` started on this machine.")
    p.add_argument("-f", "--force", action="store_true", help="SIGKILL at once")
    p.add_argument("-g", "--grace-period", type=float, default=16.0, help="seconds before SIGKILL")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    state = _load()
    records = state["processes"]
    grace = 0.5 if args.force else args.grace_period
    # Agents first (each stops its workers), the scheduler last so their reports still reach it.
    stopped = _stop_pids([r["pid"] for r in records if r["role"] == "node"], grace)
    stopped += _stop_pids([r["pid"] for r in records if r["role"] == "scheduler"], grace)
    (state_dir() / "cluster.json").unlink(missing_ok=True)
    print(f"Stopped all {len(stopped)} Podium processes." if stopped else "Did not find any active Podium processes.")
    return 0


_COMMANDS = {"start": _start, "status": _status, "stop": _stop}


def main(argv: list[str] | None = None) -> int:
    """Run ``ray <start|status|stop> ...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: ray {start,status,stop} ...   (Podium's ray command; see podium/compat/raycli.py)")
        return 0 if argv else 2
    command = _COMMANDS.get(argv[0])
    if command is None:
        print(f"ray {argv[0]}: not provided by Podium's ray command (start, status, stop); on Podium use "
              "the `podium` command (podium status, podium logs, podium job ...)", file=sys.stderr)
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
