"""Data across hosts: Podium's TCP path beside its shared memory, and Ray across two raylets.

    python -m bench.crosshost [--n 1 2 4 8] [--payload-mib 1 16 128] [--gib] [--repeat K]
                              [--ray-python PATH] [--json PATH]

Loopback "nodes" on one machine share /dev/shm, so a plain local run never takes the path a
remote worker takes. Here each configuration runs in a child process of its own:

- ``podium same-host``: the default (shared memory for payloads of 1 MiB and more);
- ``podium cross-host``: ``PODIUM_DISABLE_SHM=1``, so every client treats its workers as
  remote: every byte crosses a TCP socket (the raw call socket's bulk frames);
- ``podium cross-host tls``: the same with mutual TLS (the raw call socket under TLS);
- ``podium same-host 4k-pages`` / ``podium cross-host 4k-pages`` (only when named): the
  workers without huge pages for torch's buffers (``THP_MEM_ALLOC_ENABLE=0``), the baseline
  of the ``fresh`` cell;
- ``ray one-node``: verl's RayWorkerGroup on ``ray.init()``;
- ``ray two-nodes``: ``ray.cluster_utils.Cluster`` with a head of 0 CPUs and a second raylet
  holding the group, so arguments and results cross Ray's object manager.

Measures, per N (MB = 10^6 bytes; median of ``--repeat`` after one warm-up):

- ``dp``: DP_COMPUTE_PROTO round trip of one float32 tensor (MB/s = 2 x payload / time);
- ``to_worker`` / ``from_worker`` (N=1): the payload one way, as a ONE_TO_ALL argument kept
  by the worker, and as the value it returns;
- ``fresh`` (N=1): a new tensor the method makes (``torch.ones``) and returns: what a step's
  log-probs are; the worker's first touch of its pages is in the time;
- ``w2w``: a DataProtoFuture (the held results of a ``blocking=False`` call on a producer
  group) consumed by a second group of N: every consumer fetches its rows from the
  producers itself (MB/s = payload / time of the consuming call).

Before and after Podium's modes it measures the machine's own limits (:mod:`bench.floors`:
loopback TCP, TLS, memcpy) and holds each cell against them: on a 2-core VM the limits
themselves move by 2x from one run to the next.

Benchmarks are not tests: nothing here asserts a time. ``python -m bench`` runs this too
(``--no-crosshost`` skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

from bench import workloads
from bench.measure import MARKER, deadline, emit

MODES = {
    "podium same-host": ("podium", {}),
    "podium cross-host": ("podium", {"PODIUM_DISABLE_SHM": "1"}),
    "podium cross-host tls": ("podium", {"PODIUM_DISABLE_SHM": "1", "BENCH_TLS": "1"}),
    # The same two without the workers' huge pages for torch (what workers had before issue
    # 30): the fresh-result cell beside its baseline. Not in the default run.
    "podium same-host 4k-pages": ("podium", {"THP_MEM_ALLOC_ENABLE": "0"}),
    "podium cross-host 4k-pages": ("podium", {"PODIUM_DISABLE_SHM": "1", "THP_MEM_ALLOC_ENABLE": "0"}),
    "ray one-node": ("ray", {}),
    "ray two-nodes": ("ray", {"BENCH_RAY_NODES": "2"}),
}
MEASURES = ("dp", "to_worker", "from_worker", "fresh", "w2w")


def define_workers(api: Any) -> tuple[type, type]:
    """(the worker that moves payloads, the consumer of a DataProtoFuture), on ``api``."""
    Worker, register, Dispatch = api.Worker, api.register, api.Dispatch

    class Mover(Worker):
        """Takes, keeps, returns and echoes payloads."""

        def __init__(self):
            super().__init__()
            self.kept = None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def keep(self, value):
            """Keep ``value`` (the controller-to-worker measure)."""
            self.kept = value

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def give(self):
            """Return what was kept (the worker-to-controller measure)."""
            return self.kept

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def fresh(self, nbytes):
            """A new float32 tensor of ``nbytes`` (the fresh-result measure: log-probs, values
            and sequences are new tensors every step)."""
            import torch

            return torch.ones(nbytes // 4)

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def add_one(self, data):
            """+1 in place on every tensor of this shard, sent back."""
            for key in list(data.batch.keys()):
                data.batch[key] += 1
            return data

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def produce(self, data):
            """This shard, held here for a consumer group (a DataProtoFuture)."""
            return data

    class Consumer(Worker):
        """Reads the rows a producer group holds."""

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def consume(self, data):
            """One row per rank: how many bytes of tensors this rank received."""
            import torch

            total = sum(t.numel() * t.element_size() for t in data.batch.values())
            return api.DataProto.from_dict(tensors={"nbytes": torch.tensor([total])})

    return Mover, Consumer


# ------------------------------------------------------------------------------------ child


def _timed(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _start(backend: str, max_n: int) -> Any:
    if backend == "podium":
        from bench.podium_side import PodiumAdapter

        adapter: Any = PodiumAdapter()
        if os.environ.get("BENCH_TLS"):
            from podium import init
            from tests.support.certs import make_tls

            init(num_cpus=max(2 * max_n, 1), log_to_driver=False, tls=make_tls(tempfile.mkdtemp()))
        else:
            adapter.start(2 * max_n)
        return adapter
    from bench.ray_side import RayAdapter

    adapter = RayAdapter()
    if os.environ.get("BENCH_RAY_NODES") == "2":
        import ray
        from ray.cluster_utils import Cluster

        # The driver's node holds no CPU, so every bundle lands on the second raylet and
        # each argument and result crosses the object manager.
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        cluster.add_node(num_cpus=2 * max_n)
        ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
        adapter.cluster = cluster
    else:
        adapter.start(2 * max_n)
    return adapter


def child(mode: str, ns: list[int], mibs: list[int], repeat: int, step_timeout: float) -> int:
    """Measure one configuration; prints MARKER lines."""
    import torch

    backend = MODES[mode][0]
    api = workloads.verl_api(backend)
    Mover, Consumer = define_workers(api)
    adapter = _start(backend, max(ns))

    def cell(measure: str, n: int, mib: int, fn) -> None:
        row = {"mode": mode, "measure": measure, "n": n, "payload_mib": mib}
        try:
            with deadline(step_timeout, f"{mode} {measure} N={n} {mib} MiB"):
                seconds = fn()
            row["value"] = (mib << 20) / seconds / 1e6
        except Exception as exc:  # noqa: BLE001 - a failed step is a cell with its error
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        emit(row)

    try:
        for n in ns:
            movers = adapter.make_group(Mover, n)
            consumers = adapter.make_group(Consumer, n)
            for mib in mibs:
                rows = workloads.PAYLOAD_ROWS
                data = api.DataProto.from_dict(tensors={"x": torch.zeros(rows, (mib << 20) // 4 // rows)})
                cell("dp", n, mib, lambda: _timed(lambda: movers.add_one(data), repeat) / 2)
                if n == 1:
                    tensor = torch.zeros((mib << 20) // 4)
                    cell("to_worker", n, mib, lambda: _timed(lambda: movers.keep(tensor), repeat))
                    cell("from_worker", n, mib, lambda: _timed(lambda: movers.give(), repeat))
                    movers.keep(None)
                    cell("fresh", n, mib, lambda: _timed(lambda: movers.fresh(mib << 20), repeat))

                def w2w() -> float:
                    future = movers.produce(data)  # held by the producers
                    return _timed(lambda: consumers.consume(future), repeat)

                cell("w2w", n, mib, w2w)
                del data
            adapter.destroy_group(consumers)
            adapter.destroy_group(movers)
    finally:
        adapter.stop()
        cluster = getattr(adapter, "cluster", None)
        if cluster is not None:
            cluster.shutdown()
    return 0


# ----------------------------------------------------------------------------------- parent


def settle(quiet: float = 0.9, longest: float = 30.0) -> None:
    """Wait (at most ``longest`` seconds) until the machine is at least ``quiet`` idle over
    one second: the previous child's processes take a while to go (1 GiB freed, Ray's
    raylets), and a mode measured in their wake reads up to 2x slower."""
    def busy_total() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            ticks = list(map(int, stat.readline().split()[1:]))
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks)

    end = time.monotonic() + longest
    while time.monotonic() < end:
        busy, total = busy_total()
        time.sleep(1.0)
        busy2, total2 = busy_total()
        if total2 > total and (busy2 - busy) / (total2 - total) <= 1 - quiet:
            return


def run_mode(mode: str, args: argparse.Namespace) -> list[dict]:
    """One child per configuration, with a deadline; its cells (a failure becomes error cells)."""
    from bench.children import child_env, reap_run

    settle()
    backend, extra = MODES[mode]
    python = args.ray_python if backend == "ray" else sys.executable
    run_id = uuid.uuid4().hex
    env = child_env(run_id) | extra
    cmd = [python, "-m", "bench.crosshost", "--child", mode, "--n", *map(str, args.n),
           "--payload-mib", *map(str, args.payload_mib), "--repeat", str(args.repeat),
           "--step-timeout", str(args.step_timeout)]
    budget = 120 + args.step_timeout * len(args.n) * (len(args.payload_mib) * 5 + 2)
    cells: list[dict] = []
    log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench-crosshost-{run_id[:8]}.log")
    error = None
    with open(log_path, "w") as log:
        try:
            out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                 timeout=budget, start_new_session=True).stdout
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or ""
            out = out.decode() if isinstance(out, bytes) else out
            error = f"ran past its {budget:.0f} s deadline (log {log_path})"
        finally:
            reap_run(run_id)
    for line in out.splitlines():
        if line.startswith(MARKER):
            cells.append(json.loads(line[len(MARKER):]))
            c = cells[-1]
            print(f"  {mode} {c['measure']} N={c['n']} {c['payload_mib']} MiB: "
                  f"{c.get('value', 0):.0f} MB/s {c.get('error', '')}", file=sys.stderr, flush=True)
    if not cells:
        cells.append({"mode": mode, "measure": "dp", "n": args.n[0], "payload_mib": args.payload_mib[0],
                      "error": error or f"no result (log {log_path})"})
    return cells


def table(cells: list[dict], modes: list[str]) -> str:
    """One markdown table: a row per (measure, N, payload), a column per mode, and the ratios
    Podium cross-host / Ray two-nodes and Podium cross-host / same host."""
    by = {(c["mode"], c["measure"], c["n"], c["payload_mib"]): c for c in cells}
    keys = sorted({(c["measure"], c["n"], c["payload_mib"]) for c in cells},
                  key=lambda k: (MEASURES.index(k[0]) if k[0] in MEASURES else 9, k[1], k[2]))
    head = ["measure", "N", "MiB", *modes, "cross-host / ray two-nodes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def value(mode: str, key: tuple) -> float | None:
        c = by.get((mode, *key))
        return c.get("value") if c else None

    for key in keys:
        row = [key[0], str(key[1]), str(key[2])]
        for mode in modes:
            c = by.get((mode, *key))
            row.append("–" if c is None else (f"error: {c['error'][:60]}" if "error" in c else f"{c['value']:,.0f}"))
        mine, ray = value("podium cross-host", key), value("ray two-nodes", key)
        row.append(f"{mine / ray:.1f}x" if mine and ray else "–")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def run_floors(args: argparse.Namespace) -> dict[str, float]:
    """The machine's limits now (:mod:`bench.floors`, in a child of its own), at the
    largest payload of the run."""
    settle()
    mib = min(max(args.payload_mib), 128)
    out = subprocess.run([sys.executable, "-m", "bench.floors", "--mib", str(mib)], stdout=subprocess.PIPE,
                         text=True, timeout=600).stdout
    floor = json.loads(out.strip().splitlines()[-1])
    print(f"  limits ({mib} MiB): {floor}", file=sys.stderr, flush=True)
    return {"mib": mib, **floor}


# (measure, mode, the limit it is held against)
_AGAINST = [("to_worker", "podium cross-host", "tcp"), ("from_worker", "podium cross-host", "tcp"),
            ("dp", "podium cross-host", "tcp"), ("w2w", "podium cross-host", "tcp"),
            ("to_worker", "podium cross-host tls", "tls"), ("from_worker", "podium cross-host tls", "tls"),
            ("dp", "podium cross-host tls", "tls"), ("w2w", "podium cross-host tls", "tls"),
            ("dp", "podium same-host", "memcpy")]


def limits_table(cells: list[dict], limits: list[dict]) -> str:
    """The limits measured before and after Podium's modes, and each cell at their payload
    size as a fraction of their mean (as the issue states its goals: a ``dp`` round trip,
    MB/s counted both ways, against one-way limits)."""
    mib = limits[0]["mib"]
    mean = {name: statistics.mean(limit[name] for limit in limits) for name in ("tcp", "tls", "memcpy")}
    lines = [f"Limits of this machine ({mib} MiB, median of 5, before / after Podium's modes): "
             + "; ".join(f"{name} {limits[0][name]:,} / {limits[-1][name]:,} MB/s" for name in mean), "",
             "| measure | mode | N | MB/s | limit | fraction of the limit (mean of the two) |",
             "|---|---|---|---|---|---|"]
    for measure, mode, limit in _AGAINST:
        for c in sorted((c for c in cells if c["mode"] == mode and c["measure"] == measure
                         and c["payload_mib"] == mib and "value" in c), key=lambda c: c["n"]):
            lines.append(f"| {measure} | {mode} | {c['n']} | {c['value']:,.0f} | {limit} | "
                         f"{c['value'] / mean[limit]:.2f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m bench.crosshost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--payload-mib", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--gib", action="store_true", help="also 1 GiB at N=1 (Podium modes)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--step-timeout", type=float, default=180.0)
    parser.add_argument("--modes", nargs="+", choices=list(MODES),
                        default=[mode for mode in MODES if not mode.endswith("4k-pages")])
    parser.add_argument("--ray-python", default=os.environ.get("BENCH_RAY_PYTHON", sys.executable))
    parser.add_argument("--json", metavar="PATH", help="also write the cells here, a JSON line each")
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run each configuration's child, then print the table."""
    args = parse_args(argv)
    if args.child:
        return child(args.child, args.n, args.payload_mib, args.repeat, args.step_timeout)
    from bench.children import importable

    cells: list[dict] = []
    modes = []
    limits = [run_floors(args)]
    for mode in args.modes:
        backend = MODES[mode][0]
        if backend == "ray" and len(limits) == 1:
            limits.append(run_floors(args))  # before Ray: its processes load the machine for minutes after
        reason = importable(args.ray_python if backend == "ray" else sys.executable, backend)
        if reason:
            print(f"{mode}: not measured ({reason})", file=sys.stderr)
            continue
        modes.append(mode)
        cells += run_mode(mode, args)
        if args.gib and backend == "podium" and 1 in args.n:
            cells += run_mode(mode, argparse.Namespace(**{**vars(args), "n": [1], "payload_mib": [1024],
                                                          "repeat": max(1, args.repeat - 1)}))
    if len(limits) == 1:
        limits.append(run_floors(args))
    print(f"# Data across hosts ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; MB/s, higher is better)\n")
    print(table(cells, modes))
    print()
    print(limits_table(cells, limits))
    if args.json:
        with open(args.json, "w") as out:
            out.writelines(json.dumps(c, sort_keys=True) + "\n" for c in cells)
            out.writelines(json.dumps({"measure": "floors", "when": when, **floor}, sort_keys=True) + "\n"
                           for when, floor in zip(("before", "after"), limits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
