"""The Podium side of the benchmark: podium.controller's WorkerGroup on an embedded cluster.

    python -m bench.podium_side [--n 1 2 4 8] [--payload-mib 1 16 128] [--repeat K]

Run by ``python -m bench`` in a child process of its own; prints BENCHCELL lines
(see bench.measure). The worker class is the same body as the Ray side's, built on
``podium.worker``'s Worker/register/Dispatch.
"""

from __future__ import annotations

import sys
from typing import Any

from bench.measure import Adapter, run_child


class PodiumAdapter(Adapter):
    """Podium: init() (embedded scheduler + node agent), ResourcePool, ClassWithInitArgs, WorkerGroup."""

    name = "podium"
    api = "podium"

    def versions(self) -> dict:
        """Podium, grpcio and torch versions."""
        import grpc
        import podium
        import torch

        return {"podium": podium.__version__, "grpcio": grpc.__version__, "torch": torch.__version__}

    def start(self, max_n: int) -> None:
        """init() an embedded cluster with one logical CPU per worker (as the Ray side gets).

        Worker output is not streamed to this process, as on the Ray side (log_to_driver=False).
        """
        import inspect

        from podium import init

        options = {"num_cpus": max(max_n, 1)}
        if "log_to_driver" in inspect.signature(init).parameters:
            options["log_to_driver"] = False
        init(**options)

    def make_group(self, worker_cls: type, n: int) -> Any:
        """A WorkerGroup of ``n`` CPU workers of ``worker_cls``."""
        from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup

        pool = ResourcePool(process_on_nodes=[n], use_gpu=False, max_colocate_count=1)
        return WorkerGroup(resource_pool=pool, ray_cls_with_init=ClassWithInitArgs(worker_cls),
                           device_name="cpu")

    def destroy_group(self, group: Any) -> None:
        """Stop the group's workers and release its placement groups."""
        group.shutdown()

    def get_all(self, group: Any, results: list) -> list:
        """podium.controller.get over every call's refs (one list per call)."""
        from podium import get

        return get([ref for refs in results for ref in refs])

    def stop(self) -> None:
        """shutdown(): ends every group and the embedded scheduler and node agent."""
        from podium import shutdown

        shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the Podium child."""
    return run_child(PodiumAdapter(), argv)


if __name__ == "__main__":
    sys.exit(main())
