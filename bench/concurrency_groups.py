"""A control method in its own concurrency group, timed while 1,000 ``generate`` calls are
in flight on the same actor (verl #7990's starvation; issue #49's goal: at most 50 ms).

    podium run --num-cpus 2 -- python bench/concurrency_groups.py [--in-flight 1000] [--pings 50]

Plain ``import ray`` (the stand-in ``podium run`` puts on the path). One async actor with
``max_concurrency`` = ``--in-flight`` and a ``control`` group of 1: ``--in-flight`` calls of
``generate`` wait on an event (all of them running at once in the default group), then
``--pings`` calls of ``status`` (the control group) are made one after the other and each
is timed from ``.remote()`` to ``ray.get`` returning. Prints one JSON line: the median, the
90th percentile and the largest of those times in ms, and how many ``generate`` calls were
running meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import ray


@ray.remote(concurrency_groups={"control": 1})
class Engine:
    """``generate`` holds its slot until :meth:`open`; ``status`` answers from the control group."""

    def __init__(self) -> None:
        self.running = 0
        self.gate: asyncio.Event | None = None

    def _gate(self) -> asyncio.Event:
        if self.gate is None:
            self.gate = asyncio.Event()
        return self.gate

    async def generate(self, i: int) -> int:
        """One long request: waits until opened."""
        self.running += 1
        try:
            await asyncio.wait_for(self._gate().wait(), 600)
        finally:
            self.running -= 1
        return i

    @ray.method(concurrency_group="control")
    async def status(self) -> int:
        """How many ``generate`` calls are running."""
        return self.running

    @ray.method(concurrency_group="control")
    async def open(self) -> None:
        """Let every ``generate`` call finish."""
        self._gate().set()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--in-flight", type=int, default=1000)
    parser.add_argument("--pings", type=int, default=50)
    args = parser.parse_args()
    engine = Engine.options(max_concurrency=args.in_flight).remote()
    ray.get(engine.status.remote())  # built
    refs = [engine.generate.remote(i) for i in range(args.in_flight)]
    deadline = time.monotonic() + 300
    while ray.get(engine.status.remote()) < args.in_flight:
        if time.monotonic() > deadline:
            raise SystemExit("the generate calls never all started")
        time.sleep(0.05)
    times, running = [], []
    for _ in range(args.pings):
        started = time.perf_counter()
        running.append(ray.get(engine.status.remote()))
        times.append((time.perf_counter() - started) * 1000)
    ray.get(engine.open.remote())
    assert ray.get(refs, timeout=300) == list(range(args.in_flight))
    times.sort()
    print(json.dumps({"bench": "concurrency_groups", "in_flight": args.in_flight, "pings": args.pings,
                      "running_min": min(running), "control_ms_median": round(statistics.median(times), 2),
                      "control_ms_p90": round(times[int(0.9 * (len(times) - 1))], 2),
                      "control_ms_max": round(max(times), 2)}))


if __name__ == "__main__":
    main()
