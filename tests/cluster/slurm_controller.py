"""The controller script test_slurm.py submits: a WorkerGroup of two workers on the Slurm-run cluster.

    python slurm_controller.py [SECONDS [STATUS]]   # then sleep SECONDS (to be cancelled), exit STATUS

``PODIUM_TEST_PROCESS_ON_NODES`` (default "2") sizes the pool. Every worker reports where it runs; the script prints one "controller:" line per rank,
then "controller: workergroup ok".
"""

from __future__ import annotations

import os
import sys
import time

from podium import init, shutdown
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.worker import Dispatch, Worker, register


class Where(Worker):
    """Reports its rank, pid, GPU and Slurm job."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self) -> dict:
        """This rank's placement."""
        return {"rank": self.rank, "pid": os.getpid(), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "job": os.environ.get("SLURM_JOB_ID"), "node": os.environ.get("SLURMD_NODENAME")}


def main() -> int:
    """Run the group; sleep afterwards when asked."""
    init(address=os.environ["PODIUM_ADDRESS"])
    try:
        counts = [int(n) for n in os.environ.get("PODIUM_TEST_PROCESS_ON_NODES", "2").split(",")]
        pool = ResourcePool(process_on_nodes=counts, use_gpu=True, max_colocate_count=1)
        group = WorkerGroup(resource_pool=pool, ray_cls_with_init=ClassWithInitArgs(Where))
        for info in group.where():
            print(f"controller: rank {info['rank']} pid {info['pid']} gpus {info['gpus']} "
                  f"job {info['job']} node {info['node']}", flush=True)
        print("controller: workergroup ok", flush=True)
        if len(sys.argv) > 1:
            print("controller: sleeping", flush=True)
            time.sleep(float(sys.argv[1]))
    finally:
        shutdown()
    return int(sys.argv[2]) if len(sys.argv) > 2 else 0


if __name__ == "__main__":
    sys.exit(main())
