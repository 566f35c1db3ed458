"""A training step made slow by one rank, and the three tools that find it.

Four ranks run ``train_step``; rank 2's data loader is slow. The script then:

1. writes the run's Chrome trace (``podium.timeline``, open it in https://ui.perfetto.dev or
   ``chrome://tracing``) and prints each rank's median step time read from it;
2. asks for the Python stack of rank 2 while a step runs (``podium.stacks``; the same as
   ``podium stack --group trainer --rank 2`` from a shell);
3. leaves the dashboard's group view to you: with a cluster from ``podium up``, run this with
   ``PODIUM_ADDRESS`` set and open the scheduler's page; the straggler's cells are red.

    python examples/slow_step.py [--timeline slow_step.json]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import threading
import time

import podium
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.worker import Dispatch, Worker, register


def load_batch(rank: int) -> list[int]:
    """A data loader; rank 2's reads from a slow disk."""
    time.sleep(0.4 if rank == 2 else 0.02)
    return list(range(8))


class Trainer(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, step: int) -> int:
        batch = load_batch(self.rank)
        return sum(batch) + step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeline", default="slow_step.json", help="where to write the trace")
    args = parser.parse_args()
    podium.init()
    wg = WorkerGroup(ResourcePool([4], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Trainer),
                     name_prefix="trainer")
    for step in range(5):
        wg.train_step(step)

    podium.timeline(args.timeline)
    per_rank = collections.defaultdict(list)
    for event in podium.timeline():
        if event["ph"] == "X" and event["cat"] == "call" and event["name"] == "train_step":
            per_rank[event["tid"]].append(event["dur"] / 1000)
    print(f"trace written to {args.timeline}; train_step per rank (median ms):")
    for rank in sorted(per_rank):
        print(f"  rank {rank}: {statistics.median(per_rank[rank]):7.1f}")

    running = threading.Thread(target=wg.train_step, args=(5,))
    running.start()
    time.sleep(0.2)  # the step is under way: where is rank 2?
    print(podium.stacks(group=wg, rank=2))
    running.join()
    wg.shutdown()
    podium.shutdown()


if __name__ == "__main__":
    main()
