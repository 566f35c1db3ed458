"""Placement throughput of the pure scheduling core on a large synthetic cluster.

``python -m bench.placement [--nodes 1000] [--groups 20000] [--seed 0]`` builds a
snapshot of N nodes x 8 GPUs (64 CPUs each), places a stream of mixed placement
groups, applies each placement to the snapshot and releases the oldest groups to
keep the cluster around two-thirds full, then prints placement groups per second
and p50/p99 of one ``place()`` call in microseconds. Not a test: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

from podium.resources import BundleSpec, Strategy
from podium.scheduler.core import (Infeasible, NodeView, Placement, PlacementRequest, Snapshot,
                                   apply, place, release)


def _request(bundle: dict, n: int, strategy: Strategy) -> PlacementRequest:
    return PlacementRequest((BundleSpec.from_resources(bundle),) * n, strategy)


#: The mix: (weight, request). verl pools (STRICT_PACK of 8 / PACK of 4 whole GPUs),
#: a wide SPREAD, fractional bundles, distinct-node groups and CPU-only groups.
MIX = [
    (30, _request({"CPU": 1, "GPU": 1}, 8, Strategy.STRICT_PACK)),
    (25, _request({"CPU": 1, "GPU": 1}, 4, Strategy.PACK)),
    (10, _request({"CPU": 1, "GPU": 1}, 16, Strategy.SPREAD)),
    (15, _request({"CPU": 1, "GPU": 1 / 3}, 3, Strategy.STRICT_PACK)),
    (10, _request({"CPU": 2, "GPU": 0.5}, 6, Strategy.PACK)),
    (5, _request({"CPU": 2, "GPU": 1}, 4, Strategy.STRICT_SPREAD)),
    (5, _request({"CPU": 4}, 2, Strategy.PACK)),
]


def cluster(nodes: int) -> Snapshot:
    """N idle nodes of 8 GPUs and 64 CPUs, addresses 10.x.y.z."""
    return Snapshot(tuple(
        NodeView.idle(f"node-{i}", f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", cpus=64, gpus=8)
        for i in range(nodes)))


def _pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run(nodes: int, groups: int, seed: int, fill: float) -> dict:
    """Run the stream; returns the measurements."""
    rng = random.Random(seed)
    weights = [w for w, _ in MIX]
    requests = [r for _, r in MIX]
    snap = cluster(nodes)
    total_gpus = nodes * 8
    started = time.perf_counter()
    snap.node("node-0")  # build the index outside the timed calls, as a warm service would
    build_s = time.perf_counter() - started
    live: collections.deque = collections.deque()
    used_gpus = 0.0
    place_us: list[float] = []
    counts = collections.Counter()
    t0 = time.perf_counter()
    for _ in range(groups):
        req = rng.choices(requests, weights)[0]
        t = time.perf_counter_ns()
        result = place(req, snap)
        place_us.append((time.perf_counter_ns() - t) / 1000)
        counts[type(result).__name__] += 1
        if isinstance(result, Placement):
            snap = apply(snap, result, req)
            live.append((result, req))
            used_gpus += sum(b.gpu_units for b in req.bundles) / 720720
        elif isinstance(result, Infeasible):
            raise SystemExit(f"unexpected Infeasible: {result.message}")
        # Keep the cluster from filling: release the oldest groups (and always one
        # after an Unavailable, as a finished job would).
        while live and (used_gpus > fill * total_gpus or not isinstance(result, Placement)):
            old, old_req = live.popleft()
            snap = release(snap, old, old_req)
            used_gpus -= sum(b.gpu_units for b in old_req.bundles) / 720720
            result = None if isinstance(result, Placement) else old
    elapsed = time.perf_counter() - t0
    place_us.sort()
    return {"nodes": nodes, "groups": groups, "elapsed_s": elapsed, "index_build_ms": build_s * 1e3,
            "groups_per_s": groups / elapsed, "place_only_per_s": groups / (sum(place_us) / 1e6),
            "p50_us": _pct(place_us, 0.50), "p99_us": _pct(place_us, 0.99),
            "mean_us": statistics.fmean(place_us), "results": dict(counts)}


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--groups", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fill", type=float, default=0.66, help="GPU fraction kept in use")
    args = parser.parse_args(argv)
    r = run(args.nodes, args.groups, args.seed, args.fill)
    print(f"cluster: {r['nodes']} nodes x 8 GPUs, 64 CPUs; index built in {r['index_build_ms']:.1f} ms")
    print(f"stream: {r['groups']} placement groups, results {r['results']}")
    print(f"end to end (place + apply + release): {r['groups_per_s']:.0f} groups/s")
    print(f"place() alone: {r['place_only_per_s']:.0f} groups/s; per call p50 {r['p50_us']:.0f} us, "
          f"p99 {r['p99_us']:.0f} us, mean {r['mean_us']:.0f} us")


if __name__ == "__main__":
    main()
