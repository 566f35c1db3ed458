"""512 torch workers per controller, on one node and over 8: ``python -m bench.scale512``.

    python -m bench.scale512 [--n 512] [--nodes 1 8] [--latency-calls 50] [--json PATH]
                             [--plain] [--profile DIR] [--perf PATH]

Per (nodes, N), in a child process of its own (ended, with everything it started, by run id
as in bench.children): one cluster, one WorkerGroup of N workers whose ``__init__`` imports
torch, measuring

* cold start: ``WorkerGroup(...)`` -> first ``ONE_TO_ALL`` returned, with the phase
  breakdown (spawn requested, forked, serving, constructed, first call; latest rank each);
* no-op ``ONE_TO_ALL`` latency (median and p90 after warm-up);
* memory per worker: PSS (``/proc/<pid>/smaps_rollup``) after the no-op calls, mean over ranks;
* shutdown: ``group.shutdown()`` -> every worker process gone (no ``/proc/<pid>``, or a
  zombie) *and* the scheduler reporting every slot free (no worker starting, running or
  stopping, no placement group holding bundles); then ``podium.shutdown()`` on its own.

``--nodes 1`` is the embedded cluster (``podium.init(num_cpus=N)``: scheduler and one node
agent). ``--nodes K`` (K > 1) starts K real ``podium node`` agents on 127.0.0.2.. with one
scheduler (``podium.cli.localcluster.up``, as ``podium up`` does), each agent with its own
fork server and N/K real worker processes; the pool is ``process_on_nodes=[N/K] * K``.

Before the group is built the child waits until the cluster is idle (the agents' fork
servers import torch after they answer), so that is not billed to cold start. Not a test:
nothing asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

MARKER = "SCALE512 "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m bench.scale512", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[512], help="workers per group")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 8], help="node agents (1: embedded)")
    parser.add_argument("--latency-calls", type=int, default=50)
    parser.add_argument("--plain", action="store_true", help="workers that do not import torch")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline of one child, seconds")
    parser.add_argument("--json", metavar="PATH", help="also write one JSON line per run here")
    parser.add_argument("--profile", metavar="DIR",
                        help="py-spy (collapsed stacks) of the controller, scheduler, agents and fork "
                             "servers from group build to shutdown, one file per process in DIR")
    parser.add_argument("--perf", metavar="PATH",
                        help="`perf record -a -g` (whole machine) over the cold start into PATH.kK.nN "
                             "and over the shutdown into PATH.kK.nN.shutdown")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every (nodes, N) in a child, then print one table and the JSON lines."""
    args = parse_args(argv)
    if args.child:
        return _child(args)
    rows = []
    for nodes in args.nodes:
        for n in sorted(args.n):
            print(f"nodes={nodes} N={n} ...", file=sys.stderr, flush=True)
            rows.append(_run_child(args, nodes, n))
            print(f"  {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    print(f"# 512 workers ({os.cpu_count()} CPUs; 1-min load average {os.getloadavg()[0]:.1f} at the end)\n")
    print("| nodes | N | cold start s | no-op median ms | PSS/worker MiB | group shutdown s | "
          "podium.shutdown s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("error"):
            print(f"| {r['nodes']} | {r['n']} | error: {r['error'][:200]} | | | | |")
            continue
        print(f"| {r['nodes']} | {r['n']} | {r['cold_start_s']:.2f} | {r['noop_median_ms']:.1f} | "
              f"{r['pss_mib']:.1f} | {r['shutdown_s']:.2f} | {r.get('podium_shutdown_s', float('nan')):.2f} |")
    print()
    for r in rows:
        if not r.get("error"):
            print(f"cold start breakdown nodes={r['nodes']} N={r['n']}: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["breakdown"].items() if isinstance(v, float)))
            print(f"cold start CPU s nodes={r['nodes']} N={r['n']}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["cpu_s"].items()))
            print(f"shutdown nodes={r['nodes']} N={r['n']}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["shutdown"].items()) + "; CPU s " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["shutdown_cpu_s"].items()))
    lines = [json.dumps(r, sort_keys=True) for r in rows]
    print("\n".join(lines))
    if args.json:
        pathlib.Path(args.json).write_text("\n".join(lines) + "\n")
    return 0


def _run_child(args: argparse.Namespace, nodes: int, n: int) -> dict:
    from bench.children import REPO_ROOT, child_env, reap_run

    run_id = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "bench.scale512", "--child", "--n", str(n), "--nodes", str(nodes),
           "--latency-calls", str(args.latency_calls), *(["--plain"] if args.plain else []),
           *(["--profile", args.profile] if args.profile else []),
           *(["--perf", f"{args.perf}.k{nodes}.n{n}"] if args.perf else [])]
    log_path = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"scale512-k{nodes}-n{n}-{run_id[:8]}.log"
    result: dict = {"nodes": nodes, "n": n}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO_ROOT,
                                env=child_env(run_id), start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=30)
            result["error"] = f"child ran past {args.timeout:.0f} s"
        finally:
            left = reap_run(run_id)
            if left:
                print(f"warning: could not end pids {left}", file=sys.stderr)
    for line in out.splitlines():
        if line.startswith(MARKER):
            result.update(json.loads(line[len(MARKER):]))
    if "cold_start_s" not in result and "error" not in result:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        result["error"] = f"exit {proc.returncode} (log {log_path}: {' / '.join(tail)[-300:]})"
    result["log"] = str(log_path)
    return result


def _emit(**values) -> None:
    sys.stdout.write(MARKER + json.dumps(values) + "\n")
    sys.stdout.flush()


def _wait_idle(seconds_quiet: float = 1.0, deadline_s: float = 120.0) -> float:
    """Wait until this run's processes together use under a tenth of a core for
    ``seconds_quiet``; returns how long that took."""
    from bench.children import processes_of_run
    from bench.measure import processes_cpu_seconds

    run_id = os.environ.get("BENCH_RUN_ID", "")
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        pids = processes_of_run(run_id) + [os.getpid()]
        before = processes_cpu_seconds(pids)
        time.sleep(seconds_quiet)
        if processes_cpu_seconds(pids) - before < 0.1 * seconds_quiet:
            break
    return time.monotonic() - start


def _profile_targets() -> dict[int, str]:
    """pid -> role of this run's control-plane processes (and this one); call it before any
    worker exists (a forked worker's command line is its fork server's)."""
    from bench.children import processes_of_run

    spy = os.environ.get("PY_SPY", "py-spy")
    roles = {"forkhelper": "forkserver", "podium.cli scheduler": "scheduler", "podium.cli node": "agent"}
    targets = {os.getpid(): "controller"}
    for pid in processes_of_run(os.environ.get("BENCH_RUN_ID", "")):
        with contextlib.suppress(OSError):
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            for needle, role in roles.items():
                if needle in cmdline:
                    targets[pid] = role
    return targets


def _profilers(directory: str, tag: str, targets: dict[int, str]) -> list[subprocess.Popen]:
    """One ``py-spy record`` per process of ``targets`` (``$PY_SPY``, else py-spy on PATH)."""
    spy = os.environ.get("PY_SPY", "py-spy")
    pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([spy, "record", "--nonblocking", "-r", "50", "-f", "raw", "-p", str(pid),
                              "-o", f"{directory}/{tag}-{role}-{pid}.txt"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for pid, role in targets.items()]


def _stop_profilers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is not None:
            continue
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(2)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _user_system(pids: list[int]) -> tuple[float, float]:
    """User and system CPU seconds of these processes (``/proc/<pid>/stat``, clock ticks)."""
    user = system = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            user, system = user + int(fields[11]), system + int(fields[12])
    tick = os.sysconf("SC_CLK_TCK")
    return user / tick, system / tick


def _gone(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def _slots_free(rt) -> bool:
    """The scheduler reports no live worker and no placement group holding bundles."""
    from podium.v1 import common_pb2

    state = rt.run(rt.cluster_state(), timeout=60, what="cluster state")
    live = (common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING, common_pb2.WORKER_STOPPING)
    if any(w.state in live for w in state.workers):
        return False
    return not any(pg.state == common_pb2.PG_CREATED for pg in state.placement_groups)


def _child(args: argparse.Namespace) -> int:
    import podium
    from bench import workloads
    from bench.measure import _breakdown, percentile, processes_cpu_seconds, pss_mib, worker_pids
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.controller.session.runtime import get_runtime

    n, nodes = args.n[0], args.nodes[0]
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="scale512-"))
    cluster = None
    began = time.perf_counter()
    if nodes == 1:
        podium.init(num_cpus=n, log_to_driver=False)
    else:
        from podium.cli import localcluster

        if n % nodes:
            raise SystemExit(f"--n {n} is not a multiple of --nodes {nodes}")
        token = secrets.token_urlsafe(32)
        cluster = localcluster.up(workdir, nodes=nodes, gpus_per_node=0, cpus_per_node=n // nodes,
                                  port=0, http_port=0, token=token, timeout=180)
        podium.init(address=cluster.address, token=token, log_to_driver=False)
    cluster_start = time.perf_counter() - began
    settle = _wait_idle()
    api = workloads.verl_api("podium")
    cls = workloads.define_bench_worker(api, import_torch=not args.plain)
    targets = _profile_targets()
    roles_before = {pid: processes_cpu_seconds([pid]) for pid in targets}
    spies = _profilers(args.profile, f"k{nodes}-n{n}-cold", targets) if args.profile else []
    if args.perf:
        spies.append(subprocess.Popen(["perf", "record", "-a", "-g", "-o", args.perf],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    if spies:
        time.sleep(1.0)  # py-spy (perf) attaches
    try:
        start_epoch, start = time.time(), time.perf_counter()
        pool = ResourcePool(process_on_nodes=[n // nodes] * nodes, use_gpu=False, max_colocate_count=1)
        group = WorkerGroup(resource_pool=pool, ray_cls_with_init=ClassWithInitArgs(cls), device_name="cpu")
        constructed = time.perf_counter()
        group.noop()
        returned = time.perf_counter()
        _stop_profilers(spies)
        cpu: dict[str, float] = {}
        for pid, role in targets.items():  # CPU seconds each role spent in the cold start
            cpu[role] = cpu.get(role, 0.0) + processes_cpu_seconds([pid]) - roles_before[pid]
        breakdown = _breakdown(start_epoch, constructed - start, returned - start, group.startup_times())
        pids = breakdown.pop("pids")
        cpu["workers"] = processes_cpu_seconds(pids)  # all they ran since they were forked
        cpu["workers_user"], cpu["workers_system"] = _user_system(pids)
        idle_before = processes_cpu_seconds(pids)
        time.sleep(2.0)
        cpu["workers_idle_cores"] = (processes_cpu_seconds(pids) - idle_before) / 2.0
        for _ in range(10):
            group.noop()
        samples = []
        for _ in range(args.latency_calls):
            t = time.perf_counter()
            group.noop()
            samples.append((time.perf_counter() - t) * 1e3)
        sizes = [s for s in map(pss_mib, worker_pids(group)) if s is not None]
        rt = get_runtime(auto_init=False)
        if args.profile:
            spies = _profilers(args.profile, f"k{nodes}-n{n}-shutdown", targets)
        if args.perf:
            spies.append(subprocess.Popen(["perf", "record", "-a", "-g", "-o", f"{args.perf}.shutdown"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if spies:
            time.sleep(1.0)
        roles_before = {pid: processes_cpu_seconds([pid]) for pid in targets}
        t0 = time.perf_counter()
        group.shutdown()
        t_returned = time.perf_counter() - t0
        deadline = time.monotonic() + 120
        t_pids = t_slots = None
        while time.monotonic() < deadline and (t_pids is None or t_slots is None):
            if t_pids is None and all(_gone(p) for p in pids):
                t_pids = time.perf_counter() - t0
            if t_slots is None and _slots_free(rt):
                t_slots = time.perf_counter() - t0
            time.sleep(0.02)
        if t_pids is None or t_slots is None:
            left = [p for p in pids if not _gone(p)]
            raise SystemExit(f"shutdown: {len(left)} workers still alive / slots free={t_slots} after 120 s")
        shutdown_cpu: dict[str, float] = {}
        for pid, role in targets.items():
            shutdown_cpu[role] = shutdown_cpu.get(role, 0.0) + processes_cpu_seconds([pid]) - roles_before[pid]
        _stop_profilers(spies)
        t1 = time.perf_counter()
        podium.shutdown()
        podium_shutdown = time.perf_counter() - t1
        if cluster is not None:
            t2 = time.perf_counter()
            localcluster.down(workdir)
            cluster_down = time.perf_counter() - t2
            cluster = None
        else:
            cluster_down = 0.0
        _emit(cluster_start_s=cluster_start, settle_s=settle, cold_start_s=returned - start,
              breakdown={k: v for k, v in breakdown.items() if k != "env"}, cpu_s=cpu,
              noop_median_ms=statistics.median(samples), noop_p90_ms=percentile(samples, 0.9),
              pss_mib=statistics.fmean(sizes), pss_max_mib=max(sizes), workers=len(sizes),
              shutdown_s=max(t_pids, t_slots),
              shutdown={"returned": t_returned, "pids_gone": t_pids, "slots_free": t_slots},
              shutdown_cpu_s=shutdown_cpu,
              podium_shutdown_s=podium_shutdown, cluster_down_s=cluster_down)
    finally:
        _stop_profilers(spies)
        with contextlib.suppress(Exception):
            podium.shutdown()
        if cluster is not None:
            with contextlib.suppress(Exception):
                localcluster.down(workdir)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
