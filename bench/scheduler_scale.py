"""The real scheduler service with a thousand simulated nodes heartbeating.

``python -m bench.scheduler_scale [--nodes 1000] [--gpus 8] [--heartbeat 1.0]`` runs three
processes: ``podium scheduler`` (SQLite state file, the real service), the simulated nodes
(:mod:`tests.support.simnodes`: the node agent's own register and heartbeat loop, at the
interval the scheduler gives, answering spawns) and this one, which drives the phases and measures:

1. **registration**: every node registers (a cold cluster's storm);
2. **heartbeats**: ``--steady`` seconds of nothing but heartbeats;
3. **placement groups**: 8-GPU groups (8 bundles ``{"CPU": 1, "GPU": 1}``, STRICT_PACK, as a
   verl pool asks per node) created until the cluster is ``--fill`` full, then removed, one
   caller at a time and then ``--concurrency`` callers, while every node heartbeats;
4. **workers**: one worker per bundle on ``--worker-groups`` of the groups (CreateWorkers;
   the simulated agents report them RUNNING), which then stay for the restart;
5. **HTTP**: ``/v1/placement``, ``/v1/nodes`` and ``/metrics`` (time and size), and the
   dashboard rendered in headless Chromium when one is installed;
6. **restart**: SIGTERM, then a new scheduler on the same ports and state file: time to
   ``/readyz`` and until every node heartbeats again; memory before and after;
7. **after**: ``--after`` seconds more of heartbeats; every node must still be alive.

Heartbeat latency is what the simulated agent saw (send to answer, through its own loop:
an upper bound of the scheduler's handling) and, from the scheduler's own histogram, the
share of heartbeats handled within each bucket. ``--profile DIR`` runs the scheduler under
py-spy (a flame graph per incarnation). Not a test: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc

from podium import rpc
from podium.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

GIB = 1 << 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` (nearest rank); nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def memory_of(pid: int) -> dict:
    """RSS and PSS of a process in MiB (from /proc)."""
    out = {}
    try:
        for line in pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                out[key.lower() + "_mib"] = round(int(rest.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out


class Scheduler:
    """One ``podium scheduler`` process on fixed ports and a state file."""

    def __init__(self, workdir: pathlib.Path, token: str, args: argparse.Namespace) -> None:
        self.workdir = workdir
        self.token = token
        self.args = args
        self.port = _free_port()
        self.http_port = _free_port()
        self.state = workdir / "scheduler.db"
        self.proc: subprocess.Popen | None = None
        self.profiler: subprocess.Popen | None = None
        self.incarnation = 0

    @property
    def address(self) -> str:
        """gRPC host:port."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start it; returns seconds from spawn to /readyz answering 200."""
        self.incarnation += 1
        cmd = [sys.executable, "-m", "podium.cli", "scheduler", "--port", str(self.port),
               "--http-port", str(self.http_port), "--state", str(self.state),
               "--heartbeat-interval", str(self.args.heartbeat),
               "--node-lease", str(self.args.node_lease), "--log-level", "WARNING"]
        env = dict(os.environ, PODIUM_TOKEN=self.token)
        log = open(self.workdir / f"scheduler-{self.incarnation}.log", "w")
        started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"scheduler exited with {self.proc.returncode}; see {log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("scheduler not ready after 120 s")
            time.sleep(0.01)
        ready = time.perf_counter() - started
        if self.args.profile:
            out = pathlib.Path(self.args.profile) / f"scheduler-{self.incarnation}.svg"
            self.profiler = subprocess.Popen(
                [shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy"),
                 "record", "-p", str(self.proc.pid), "-o", str(out), "-r", "200", "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return ready

    def stop(self) -> None:
        """SIGTERM and wait (its profiler writes its file when the process ends)."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.profiler is not None:
            try:
                self.profiler.wait(60)
            except subprocess.TimeoutExpired:
                self.profiler.send_signal(signal.SIGINT)
                self.profiler.wait(30)
            self.profiler = None
        self.proc = None

    def get(self, path: str) -> tuple[float, int, bytes]:
        """(seconds, status, body) of an authenticated GET."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}{path}",
                                         headers={"Authorization": f"Bearer {self.token}"})
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=120) as r:
            body = r.read()
            return time.perf_counter() - started, r.status, body

    def metrics(self) -> str:
        """The /metrics text."""
        return self.get("/metrics")[2].decode()


def gauge(text: str, name: str, state: str) -> float:
    """One labelled gauge's value from Prometheus text (0 when absent)."""
    m = re.search(rf'^{name}{{state="{state}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def histogram(text: str, method: str) -> dict[float, float]:
    """The cumulative bucket counts of one method's RPC latency."""
    out = {}
    for m in re.finditer(r'^podium_scheduler_rpc_seconds_bucket{le="([^"]+)",method="'
                         + method + r'"} (\S+)$', text, re.M):
        out[float(m.group(1))] = float(m.group(2))
    return out


def bucket_shares(before: dict[float, float], after: dict[float, float]) -> dict[str, float]:
    """Share of the calls between two scrapes handled within each bucket bound."""
    total = after.get(float("inf"), 0) - before.get(float("inf"), 0)
    if total <= 0:
        return {}
    return {f"<= {le * 1000:g} ms": round((after[le] - before.get(le, 0)) / total, 5)
            for le in sorted(after) if le != float("inf") and le <= 0.1}


def wait_for(predicate, what: str, timeout: float, interval: float = 0.1) -> float:
    """Poll until true; returns the seconds it took (SystemExit on timeout)."""
    started = time.perf_counter()
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
    return time.perf_counter() - started


GROUP = scheduler_pb2.CreatePlacementGroupRequest(
    bundles=[common_pb2.Bundle(resources={"CPU": 1.0, "GPU": 1.0})] * 8,
    strategy=common_pb2.STRICT_PACK, detached=True)


async def _groups_round(stub, metadata, target: int, concurrency: int, prefix: str,
                        keep: bool, seconds: float) -> dict:
    """Create ``target`` 8-GPU groups with ``concurrency`` callers (for at most ``seconds``),
    then remove them."""
    created: list[str] = []
    create_s: list[float] = []
    remove_s: list[float] = []
    counter = iter(range(target))
    errors: list[str] = []

    stop_at = time.monotonic() + seconds

    async def creator() -> None:
        for i in counter:
            if time.monotonic() > stop_at:
                return
            request = scheduler_pb2.CreatePlacementGroupRequest()
            request.CopyFrom(GROUP)
            request.name = f"{prefix}-{i}"
            t = time.perf_counter()
            try:
                group = await stub.CreatePlacementGroup(request, timeout=30, metadata=metadata)
            except grpc.RpcError as exc:
                errors.append(f"{exc.code().name}: {exc.details()}")
                continue
            create_s.append(time.perf_counter() - t)
            if group.state != common_pb2.PG_CREATED:
                errors.append(f"{group.name} {common_pb2.PlacementGroupState.Name(group.state)}")
            created.append(group.id)

    t0 = time.perf_counter()
    await asyncio.gather(*(creator() for _ in range(concurrency)))
    create_wall = time.perf_counter() - t0
    out = {"concurrency": concurrency, "groups": len(create_s),
           "create_per_s": round(len(create_s) / create_wall, 1),
           "create_p50_ms": round(pct(create_s, 0.5) * 1000, 2),
           "create_p99_ms": round(pct(create_s, 0.99) * 1000, 2),
           "create_max_ms": round(max(create_s, default=float("nan")) * 1000, 2),
           "errors": errors[:5], "error_count": len(errors)}
    if keep:
        out["kept"] = created
        return out
    ids = iter(list(created))

    async def remover() -> None:
        for group_id in ids:
            t = time.perf_counter()
            await stub.RemovePlacementGroup(scheduler_pb2.RemovePlacementGroupRequest(id=group_id),
                                            timeout=30, metadata=metadata)
            remove_s.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(remover() for _ in range(concurrency)))
    remove_wall = time.perf_counter() - t0
    out.update({"remove_per_s": round(len(remove_s) / remove_wall, 1),
                "remove_p50_ms": round(pct(remove_s, 0.5) * 1000, 2),
                "remove_p99_ms": round(pct(remove_s, 0.99) * 1000, 2)})
    return out


async def _workers(stub, metadata, group_ids: list[str], groups: list) -> dict:
    """One worker per bundle (8 per group, one CreateWorkers call per group)."""
    latencies = []
    for n, group_id in enumerate(group_ids):
        specs = [common_pb2.WorkerSpec(name=f"w{n}-{r}", group=f"wg{n}", rank=r, world_size=8,
                                       placement_group_id=group_id, bundle_index=r,
                                       num_cpus=1, num_gpus=1, detached=True)
                 for r in range(8)]
        t = time.perf_counter()
        await stub.CreateWorkers(scheduler_pb2.CreateWorkersRequest(specs=specs, master_rank=0),
                                 timeout=60, metadata=metadata)
        latencies.append(time.perf_counter() - t)
    return {"create_workers_calls": len(latencies), "workers": 8 * len(latencies),
            "create_workers_p50_ms": round(pct(latencies, 0.5) * 1000, 2),
            "create_workers_p99_ms": round(pct(latencies, 0.99) * 1000, 2),
            "create_workers_last_ms": round(latencies[-1] * 1000, 2) if latencies else None}


def _chromium(sched: Scheduler, nodes: int) -> dict:
    """Render the dashboard in headless Chromium (when installed); the DOM must list every node."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not binary:
        return {"skipped": "no Chromium on this machine"}
    url = f"http://127.0.0.1:{sched.http_port}/#token={sched.token}"
    with tempfile.TemporaryDirectory() as profile:
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
               "--virtual-time-budget=4000", "--dump-dom", url]
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        seconds = time.perf_counter() - t
    dom = done.stdout
    render = re.search(r'data-render-ms="(\d+)"', dom)
    refreshes = re.search(r'data-refreshes="(\d+)"', dom)
    return {"seconds_to_dump_dom": round(seconds, 2), "dom_bytes": len(dom), "rc": done.returncode,
            "render_ms": int(render.group(1)) if render else None,
            "refreshes": int(refreshes.group(1)) if refreshes else 0,
            "nodes_in_dom": sum(1 for i in range(nodes) if f"sim-{i:0{len(str(nodes - 1))}d}" in dom)}


def _split(samples: list, start: float, end: float) -> list[float]:
    return [lat for sent, lat, _ in samples if start <= sent < end]


def _latency(samples: list[float]) -> dict:
    return {"count": len(samples), "p50_ms": round(pct(samples, 0.5) * 1000, 2),
            "p99_ms": round(pct(samples, 0.99) * 1000, 2),
            "max_ms": round(max(samples, default=float("nan")) * 1000, 2)}


def run(args: argparse.Namespace) -> dict:
    """Every phase; returns the results."""
    token = secrets.token_urlsafe(24)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="podium-schedscale-"))
    if args.profile:
        pathlib.Path(args.profile).mkdir(parents=True, exist_ok=True)
    sched = Scheduler(workdir, token, args)
    results: dict = {"nodes": args.nodes, "gpus_per_node": args.gpus, "heartbeat_s": args.heartbeat,
                     "node_lease_s": args.node_lease}
    stats_file = workdir / "sim.json"
    sim = None
    marks: dict[str, float] = {}
    try:
        results["first_start_ready_s"] = round(sched.start(), 3)
        env = dict(os.environ, PODIUM_TOKEN=token)
        sim = subprocess.Popen(
            [sys.executable, "-m", "tests.support.simnodes", "--scheduler", sched.address,
             "--nodes", str(args.nodes), "--gpus", str(args.gpus),
             "--connections", str(args.connections), "--stats-file", str(stats_file)],
            env=env, stdout=open(workdir / "sim.log", "w"), stderr=subprocess.STDOUT,
            cwd=pathlib.Path(__file__).resolve().parent.parent)  # tests.support is found from the root
        alive = lambda: gauge(sched.metrics(), "podium_scheduler_nodes", "NODE_ALIVE") >= args.nodes  # noqa: E731
        results["register_all_s"] = round(wait_for(alive, "every node registered", 300), 2)
        time.sleep(args.heartbeat * 2)  # heartbeat phases spread over one interval
        marks["steady_start"] = time.time()
        before = histogram(sched.metrics(), "Heartbeat")
        time.sleep(args.steady)
        after = histogram(sched.metrics(), "Heartbeat")
        marks["steady_end"] = time.time()
        results["heartbeat_server_buckets_steady"] = bucket_shares(before, after)
        results["scheduler_memory_registered"] = memory_of(sched.proc.pid)

        async def placement_phase() -> dict:
            channel = rpc.make_channel(sched.address, token, add_token=False)
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            metadata = rpc.token_metadata(token)
            target = int(args.nodes * args.fill)
            out = {"sequential": await _groups_round(stub, metadata, target, 1, "seq", False,
                                                     args.round_seconds),
                   "concurrent": await _groups_round(stub, metadata, target, args.concurrency,
                                                     "conc", False, args.round_seconds)}
            kept = await _groups_round(stub, metadata, target, args.concurrency, "kept", True,
                                      args.round_seconds)
            group_ids = kept.pop("kept")
            out["kept"] = kept
            try:
                out["workers"] = await _workers(stub, metadata, group_ids[:args.worker_groups], [])
            except grpc.RpcError as exc:  # e.g. a group lost with a node whose lease ran out
                out["workers"] = {"error": f"{exc.code().name}: {exc.details()}"}
            await channel.close()
            return out

        marks["pg_start"] = time.time()
        before = histogram(sched.metrics(), "Heartbeat")
        results["placement_groups"] = asyncio.run(placement_phase())
        after = histogram(sched.metrics(), "Heartbeat")
        marks["pg_end"] = time.time()
        results["heartbeat_server_buckets_during_pg"] = bucket_shares(before, after)
        time.sleep(1.0)  # the RUNNING reports land

        http = {}
        for path in ("/v1/placement", "/v1/nodes", "/metrics", "/v1/workers"):
            times = []
            for _ in range(3):
                time.sleep(1.1)  # past the page cache: every sample builds the page
                seconds, status, body = sched.get(path)
                times.append(seconds)
            http[path] = {"median_ms": round(statistics.median(times) * 1000, 1),
                          "max_ms": round(max(times) * 1000, 1), "bytes": len(body)}
        results["http"] = http
        results["dashboard"] = _chromium(sched, args.nodes) if args.chromium else {"skipped": "--no-chromium"}
        results["scheduler_memory_loaded"] = memory_of(sched.proc.pid)

        # Restart with the state: down, up, every node heartbeating again.
        marks["restart_start"] = time.time()
        sched.stop()
        down_at = time.time()
        results["restart_ready_s"] = round(sched.start(), 3)
        up_at = time.time()
        marks["restart_up"] = up_at
        results["scheduler_memory_restarted"] = memory_of(sched.proc.pid)
        results["restart_down_s"] = round(up_at - down_at, 3)

        time.sleep(args.after)
        marks["after_end"] = time.time()
        text = sched.metrics()
        results["nodes_alive_end"] = gauge(text, "podium_scheduler_nodes", "NODE_ALIVE")
        results["nodes_dead_end"] = gauge(text, "podium_scheduler_nodes", "NODE_DEAD")
        results["workers_running_end"] = gauge(text, "podium_scheduler_workers", "WORKER_RUNNING")
        results["groups_created_end"] = gauge(text, "podium_scheduler_placement_groups", "PG_CREATED")
        results["scheduler_memory_end"] = memory_of(sched.proc.pid)
    finally:
        if sim is not None:
            sim.send_signal(signal.SIGTERM)
            try:
                sim.wait(60)
            except subprocess.TimeoutExpired:
                sim.kill()
        sched.stop()
    stats = json.loads(stats_file.read_text())
    hb = stats["heartbeats"]
    results["heartbeat_client_steady"] = _latency(_split(hb, marks["steady_start"], marks["steady_end"]))
    results["heartbeat_client_during_pg"] = _latency(_split(hb, marks["pg_start"], marks["pg_end"]))
    # How late the simulator's own loop ran (its share of the latencies above).
    lag = [(t, seconds, 0) for t, seconds in stats.get("loop_lag", [])]
    results["simulator_loop_lag_steady"] = _latency(_split(lag, marks["steady_start"], marks["steady_end"]))
    results["simulator_loop_lag_during_pg"] = _latency(_split(lag, marks["pg_start"], marks["pg_end"]))
    if "restart_up" in marks:
        results["heartbeat_client_after_restart"] = _latency(
            _split(hb, marks["restart_up"] + 5, marks["after_end"]))
        results["simulator_loop_lag_after_restart"] = _latency(
            _split(lag, marks["restart_up"] + 5, marks["after_end"]))
        # A node is back at its first registration or answered heartbeat after the restart.
        width = len(str(args.nodes - 1))
        back: dict[str, float] = {}
        for t, node in stats["registrations"]:
            if t >= marks["restart_start"]:
                back[node] = min(t, back.get(node, t))
        for sent, lat, number in hb:
            if sent + lat >= marks["restart_up"]:
                node = f"sim-{number:0{width}d}"
                back[node] = min(sent + lat, back.get(node, sent + lat))
        results["restart_nodes_back"] = len(back)
        results["restart_all_back_after_up_s"] = (
            round(max(back.values()) - marks["restart_up"], 2) if len(back) == args.nodes else None)
        results["restart_registrations"] = sum(1 for t, _ in stats["registrations"]
                                               if t >= marks["restart_start"])
    results["heartbeat_failures_outside_restart"] = sum(
        1 for t in stats["heartbeat_failures"]
        if not marks.get("restart_start", 1e18) - 2 * args.heartbeat <= t <= marks.get("restart_up", 0) + 5)
    results["reregister_asked"] = len(stats["reregister_asked"])
    results["spawned"] = stats["spawned"]
    shutil.rmtree(workdir, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its results as JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.scheduler_scale", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat interval (s)")
    p.add_argument("--node-lease", type=float, default=10.0)
    p.add_argument("--connections", type=int, default=16, help="simulator connections to the scheduler")
    p.add_argument("--steady", type=float, default=20.0, help="seconds of heartbeats alone")
    p.add_argument("--after", type=float, default=15.0, help="seconds of heartbeats after the restart")
    p.add_argument("--fill", type=float, default=0.9, help="share of the nodes filled by groups per round")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent placement-group callers")
    p.add_argument("--round-seconds", type=float, default=60.0,
                   help="a creation round stops after this long even if the cluster is not full")
    p.add_argument("--worker-groups", type=int, default=100, help="groups given 8 workers each")
    p.add_argument("--no-chromium", dest="chromium", action="store_false")
    p.add_argument("--profile", default="", help="directory for py-spy flame graphs of the scheduler")
    p.add_argument("--json", default="", help="append the results as one JSON line here")
    args = p.parse_args(argv)
    if not 1 <= args.nodes <= 10_000 or not 0 < args.fill <= 1 or not 1 <= args.concurrency <= 256:
        p.error("--nodes in [1, 10000], --fill in (0, 1], --concurrency in [1, 256]")
    results = run(args)
    results["at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        with open(args.json, "a") as handle:
            handle.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
