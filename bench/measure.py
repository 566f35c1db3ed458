"""The measuring loop both backend children share, with a deadline on every step.

A child (``bench.ray_side`` or ``bench.podium_side``) supplies a small adapter
(start/make_group/destroy_group/get_all/stop); ``run_child`` parses the common flags,
measures each N on a fresh group, and prints one ``BENCHCELL {json}`` line per cell as
soon as it is known, so a child killed at its outer deadline still leaves what it measured.
Lines without the marker (Ray forwards worker logs to the driver's stdout) are ignored by
the parent.

Measures (cell ``measure`` names, shared with bench.report):
  cluster_start_s          ray.init() / podium init() returned (not part of cold start)
  cold_start_s             WorkerGroup constructed -> first ONE_TO_ALL returned (fresh group)
  cold_start_torch_s       the same for a worker whose __init__ imports torch
  noop_latency_median_ms   no-op ONE_TO_ALL, median after warm-up
  noop_latency_p90_ms      the same calls, 90th percentile
  noop_controller_cpu_ms   CPU time of the controller process (all its threads) per no-op call
  noop_workers_cpu_ms      CPU time of all the group's worker processes together per no-op call
  noop_controller_us_per_rank, noop_workers_us_per_rank   the same two, per rank (microseconds)
  worker_pss_mib           proportional set size of one worker, mean over ranks, after the
                           DP_COMPUTE_PROTO step (shared pages split between their sharers)
  dp_proto_mb_s            DP_COMPUTE_PROTO round trip, MB/s = 2 * payload bytes / time
  nonblocking_calls_s      blocking=False ONE_TO_ALL group calls issued then all fetched, per second
  pipelined_rank_calls_s   the same, counted per rank: rank-calls per second from one controller
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Iterator

from bench import workloads

MARKER = "BENCHCELL "
SETTLE_SECONDS = 5.0


class StepTimeout(Exception):
    """A step ran past its deadline (raised from SIGALRM in the main thread)."""


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Raise StepTimeout in the main thread if the block runs past ``seconds``.

    SIGALRM interrupts blocking waits that return to the interpreter to check signals
    (ray.get and concurrent futures do); the parent's outer deadline catches the rest.
    """
    def on_alarm(signum, frame):
        raise StepTimeout(f"{what}: no result within {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def emit(cell: dict) -> None:
    """Print one cell for the parent (flushed at once: the child may be killed any time)."""
    sys.stdout.write(MARKER + json.dumps(cell, sort_keys=True) + "\n")
    sys.stdout.flush()


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by linear interpolation."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def child_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags every backend child takes (the parent passes them; people rarely do)."""
    parser = argparse.ArgumentParser(description="one backend's measurements, as BENCHCELL lines")
    parser.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--payload-mib", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--repeat", type=int, default=5, help="timed round trips per payload")
    parser.add_argument("--cold-repeat", type=int, default=1, help="fresh groups timed per N")
    parser.add_argument("--latency-calls", type=int, default=500)
    parser.add_argument("--nonblocking-calls", type=int, default=1000)
    parser.add_argument("--step-timeout", type=float, default=120.0, help="seconds per step")
    return parser.parse_args(argv)


class Adapter:
    """What a backend child implements; the loop below is the same for both."""

    #: The backend label of its cells.
    name = "?"
    #: Whose verl-named API the worker class is built from ("ray": verl's; "podium": Podium's).
    api = "?"

    def start(self, max_n: int) -> None:
        """Start the backend's cluster (not timed)."""

    def make_group(self, worker_cls: type, n: int) -> Any:
        """A WorkerGroup of ``n`` CPU workers of ``worker_cls`` (timed by cold start)."""
        raise NotImplementedError

    def destroy_group(self, group: Any) -> None:
        """End the group's workers and free their resources."""

    def get_all(self, group: Any, results: list) -> list:
        """Materialize the results of many blocking=False group calls."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop the cluster and everything it started."""

    def versions(self) -> dict:
        """Package versions worth recording next to the numbers."""
        return {}


def run_child(adapter: Adapter, argv: list[str] | None = None) -> int:
    """Measure every N with ``adapter`` and print BENCHCELL lines; returns the exit code."""
    args = child_arguments(argv)
    api = workloads.verl_api(adapter.api)
    worker_cls = workloads.define_bench_worker(api)
    torch_worker_cls = workloads.define_bench_worker(api, import_torch=True)
    base = {"backend": adapter.name}
    emit({**base, "measure": "meta", "versions": adapter.versions()})
    try:
        with deadline(args.step_timeout, "cluster start"):
            start = time.perf_counter()
            adapter.start(max(args.n))
            cluster_start = time.perf_counter() - start
        # Both clusters keep starting helpers (Ray's idle workers and agents, Podium's fork
        # server importing torch) for a while after they answer; let that finish so it is
        # not billed to the first group. The start itself is reported as cluster_start_s.
        time.sleep(SETTLE_SECONDS)
        for n in args.n:
            emit({**base, "measure": "cluster_start_s", "n": n, "value": cluster_start, "unit": "s"})
    except BaseException as exc:  # noqa: BLE001 - report, never crash the run
        error = _describe(exc)
        for n in args.n:
            for cell in cells_of(args, n):
                emit({**base, **cell, "error": f"cluster start failed: {error}"})
        adapter.stop()
        return 1
    try:
        for n in args.n:
            _measure_n(adapter, worker_cls, torch_worker_cls, api, args, n, base)
    finally:
        with contextlib.suppress(BaseException):
            with deadline(60, "cluster stop"):
                adapter.stop()
    return 0


def cells_of(args: argparse.Namespace, n: int) -> list[dict]:
    """The cells (measure, n, payload) a child reports for one N, values not filled in."""
    cells = [{"measure": "cluster_start_s", "n": n}, {"measure": "cold_start_s", "n": n},
             {"measure": "noop_latency_median_ms", "n": n},
             {"measure": "noop_latency_p90_ms", "n": n},
             {"measure": "noop_controller_cpu_ms", "n": n}, {"measure": "noop_workers_cpu_ms", "n": n},
             {"measure": "noop_controller_us_per_rank", "n": n}, {"measure": "noop_workers_us_per_rank", "n": n}]
    cells += [{"measure": "dp_proto_mb_s", "n": n, "payload_mib": mib} for mib in args.payload_mib]
    cells.append({"measure": "worker_pss_mib", "n": n})
    cells.append({"measure": "nonblocking_calls_s", "n": n})
    cells.append({"measure": "pipelined_rank_calls_s", "n": n})
    cells.append({"measure": "cold_start_torch_s", "n": n})
    return cells


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) < 400 else text[:400] + "..."


def _measure_n(adapter: Adapter, worker_cls: type, torch_worker_cls: type, api, args: argparse.Namespace,
               n: int, base: dict) -> None:
    """All cells of one N on fresh groups; after a failed step the rest say why they were skipped."""
    base = {**base, "n": n}
    failed: str | None = None
    group = None

    def step(cells: list[dict], what: str, body: Callable[[], list[dict]]) -> None:
        nonlocal failed
        if failed is not None:
            for cell in cells:
                emit({**base, **cell, "error": f"skipped: {failed}"})
            return
        try:
            with deadline(args.step_timeout, what):
                results = body()
        except BaseException as exc:  # noqa: BLE001
            failed = f"{what} failed ({_describe(exc)})"
            print(f"[{adapter.name} n={n}] {what} failed:\n{traceback.format_exc()}", file=sys.stderr)
            for cell in cells:
                emit({**base, **cell, "error": failed})
            if isinstance(exc, KeyboardInterrupt):
                raise
            return
        for cell in results:
            emit({**base, **cell})

    def cold_start(measure: str, cls: type, keep: bool) -> Callable[[], list[dict]]:
        def body() -> list[dict]:
            nonlocal group
            samples, breakdowns = [], []
            attempts = max(1, args.cold_repeat)
            for attempt in range(attempts):
                start_epoch, start = time.time(), time.perf_counter()
                group = adapter.make_group(cls, n)
                constructed = time.perf_counter()
                group.noop()
                returned = time.perf_counter()
                samples.append(returned - start)
                stamps = group.startup_times()
                breakdowns.append(_breakdown(start_epoch, constructed - start, returned - start, stamps))
                if not keep or attempt + 1 < attempts:
                    adapter.destroy_group(group)
                    group = None
            return [{"measure": measure, "value": statistics.median(samples), "unit": "s",
                     "samples": samples, "breakdown": breakdowns[-1]}]
        return body

    def destroy() -> list[dict]:
        nonlocal group
        if group is not None:
            adapter.destroy_group(group)
            group = None
        return []

    def latency() -> list[dict]:
        for _ in range(20):
            group.noop()
        pids = worker_pids(group)
        samples = []
        budget_end = time.perf_counter() + args.step_timeout / 3
        cpu_before, workers_before = time.process_time(), processes_cpu_seconds(pids)
        for _ in range(args.latency_calls):
            start = time.perf_counter()
            group.noop()
            samples.append((time.perf_counter() - start) * 1e3)
            if time.perf_counter() > budget_end:
                break
        controller_ms = (time.process_time() - cpu_before) / len(samples) * 1e3
        workers_ms = (processes_cpu_seconds(pids) - workers_before) / len(samples) * 1e3
        stats = {"calls": len(samples), "min": min(samples), "mean": statistics.fmean(samples)}
        return [{"measure": "noop_latency_median_ms", "value": statistics.median(samples), "unit": "ms",
                 **stats},
                {"measure": "noop_latency_p90_ms", "value": percentile(samples, 0.9), "unit": "ms",
                 **stats},
                {"measure": "noop_controller_cpu_ms", "value": controller_ms, "unit": "ms", "calls": len(samples)},
                {"measure": "noop_workers_cpu_ms", "value": workers_ms, "unit": "ms", "calls": len(samples),
                 "per_worker_us": workers_ms / n * 1e3},
                {"measure": "noop_controller_us_per_rank", "value": controller_ms / n * 1e3, "unit": "us"},
                {"measure": "noop_workers_us_per_rank", "value": workers_ms / n * 1e3, "unit": "us"}]

    def memory() -> list[dict]:
        sizes = [size for size in map(pss_mib, worker_pids(group)) if size is not None]
        if not sizes:
            raise RuntimeError("no worker's /proc/<pid>/smaps_rollup was readable")
        return [{"measure": "worker_pss_mib", "value": statistics.fmean(sizes), "unit": "MiB",
                 "min": min(sizes), "max": max(sizes), "workers": len(sizes)}]

    def throughput(mib: int) -> Callable[[], list[dict]]:
        def body() -> list[dict]:
            data = workloads.make_payload(api, mib)
            nbytes = workloads.payload_nbytes(data)
            out = group.add_one(data)  # warm-up, and a correctness check (not a timing assert)
            if len(out) != len(data) or float(out.batch["x"][0, 0]) < 1.0:
                raise RuntimeError(f"add_one returned a wrong batch (len {len(out)})")
            del out
            samples = []
            for _ in range(max(1, args.repeat)):
                start = time.perf_counter()
                out = group.add_one(data)
                samples.append(time.perf_counter() - start)
                del out
            rates = [2 * nbytes / s / 1e6 for s in samples]
            return [{"measure": "dp_proto_mb_s", "payload_mib": mib, "value": statistics.median(rates),
                     "unit": "MB/s", "best": max(rates), "seconds": samples, "payload_bytes": nbytes}]
        return body

    def nonblocking() -> list[dict]:
        adapter.get_all(group, [group.noop_nonblocking() for _ in range(20)])
        calls = args.nonblocking_calls
        start = time.perf_counter()
        pending = [group.noop_nonblocking() for _ in range(calls)]
        issued = time.perf_counter()
        adapter.get_all(group, pending)
        elapsed = time.perf_counter() - start
        return [{"measure": "nonblocking_calls_s", "value": calls / elapsed, "unit": "calls/s",
                 "calls": calls, "issue_s": issued - start, "total_s": elapsed},
                {"measure": "pipelined_rank_calls_s", "value": calls * n / elapsed, "unit": "rank-calls/s",
                 "calls": calls}]

    try:
        step([{"measure": "cold_start_s"}], "cold start", cold_start("cold_start_s", worker_cls, keep=True))
        step([{"measure": "noop_latency_median_ms"}, {"measure": "noop_latency_p90_ms"},
              {"measure": "noop_controller_cpu_ms"}, {"measure": "noop_workers_cpu_ms"},
              {"measure": "noop_controller_us_per_rank"}, {"measure": "noop_workers_us_per_rank"}],
             "no-op latency", latency)
        for mib in args.payload_mib:
            step([{"measure": "dp_proto_mb_s", "payload_mib": mib}], f"DP_COMPUTE_PROTO {mib} MiB",
                 throughput(mib))
        step([{"measure": "worker_pss_mib"}], "worker memory", memory)
        step([{"measure": "nonblocking_calls_s"}, {"measure": "pipelined_rank_calls_s"}], "non-blocking calls",
             nonblocking)
        # Last, on its own group: the same cold start for a worker that imports torch in
        # __init__, as every training worker does (verl's Worker already pulls torch in on
        # the Ray side; Podium's defers it until a tensor arrives).
        failed = None
        step([], "group teardown", destroy)
        step([{"measure": "cold_start_torch_s"}], "cold start (torch)",
             cold_start("cold_start_torch_s", torch_worker_cls, keep=False))
    finally:
        if group is not None:
            try:
                with deadline(60, "group teardown"):
                    adapter.destroy_group(group)
            except BaseException as exc:  # noqa: BLE001
                print(f"[{adapter.name} n={n}] teardown failed: {_describe(exc)}", file=sys.stderr)


def worker_pids(group: Any) -> list[int]:
    """The pid of every rank of ``group`` (its ``startup_times`` say; both backends run it)."""
    stamps = group.startup_times()
    return [r["pid"] for r in (stamps if isinstance(stamps, list) else [stamps]) if isinstance(r, dict)]


def processes_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds of these processes (all their live threads) so far; gone ones count 0.

    Read from each thread's ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds the scheduler
    ran it), not from ``stat``'s clock ticks: a process that wakes for a few microseconds at
    a time is seldom running when a tick lands, so ticks count 128 echo processes as idle."""
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as stat:
                    total += int(stat.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e9


def pss_mib(pid: int) -> float | None:
    """A process's proportional set size in MiB, or None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def _breakdown(start_epoch: float, constructed_s: float, returned_s: float, stamps: Any) -> dict:
    """Where the cold start went, in seconds after construction began (latest rank per phase).

    ``process_started`` can be negative where the backend reuses a process started before
    the group (Ray's prestarted worker pool).
    """
    ranks = stamps if isinstance(stamps, list) else [stamps]
    out: dict[str, Any] = {"constructor_returned": constructed_s, "first_call_returned": returned_s}
    for key in ("process_started", "serving", "constructed", "first_call"):
        values = [r[key] for r in ranks if isinstance(r, dict) and r.get(key) is not None]
        if values:
            out[f"worker_{key}"] = max(values) - start_epoch
    env: dict[str, float] = {}
    for r in ranks:
        for key, value in (r.get("env") or {}).items() if isinstance(r, dict) else ():
            try:
                stamp = float(value)
            except ValueError:
                continue
            env[key] = max(env.get(key, float("-inf")), stamp - start_epoch)
    if env:
        out["env"] = env
    out["pids"] = [r.get("pid") for r in ranks if isinstance(r, dict)]
    return out
