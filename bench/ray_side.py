"""The Ray side of the benchmark: verl's RayWorkerGroup over a local Ray cluster.

    python -m bench.ray_side [--n 1 2 4 8] [--payload-mib 1 16 128] [--repeat K]

Run by ``python -m bench`` in a child process of its own; prints BENCHCELL lines
(see bench.measure). Needs ``ray`` and ``verl`` (bench/README.md says how to install them
without touching Podium's environment).
"""

from __future__ import annotations

import sys
from typing import Any

from bench.measure import Adapter, run_child


class RayAdapter(Adapter):
    """verl on Ray: RayResourcePool + RayClassWithInitArgs + RayWorkerGroup, CPU workers.

    The same child under ``podium run`` measures verl's own code on Podium: "verl-podium"
    (Ray mode: verl's RayWorkerGroup on the ``ray`` stand-in's actors) and, with
    ``--native-verl``, "verl-native" (verl's names resolve to Podium's worker groups).
    """

    api = "ray"

    def __init__(self) -> None:
        self._pools: dict[int, Any] = {}
        import ray

        from podium.compat import nativeverl

        #: Under ``podium run`` (the stand-in), and with ``--native-verl``.
        self.on_podium = bool(getattr(ray, "__podium__", False))
        self.native = self.on_podium and nativeverl.wanted()
        self.name = ("verl-native" if self.native else "verl-podium") if self.on_podium else "ray"

    def versions(self) -> dict:
        """Ray, verl and torch versions."""
        import ray
        import torch
        import verl

        return {"ray": ray.__version__, "verl": verl.__version__, "torch": torch.__version__}

    def start(self, max_n: int) -> None:
        """ray.init with one CPU per worker bundle, then one task round trip so the cluster is up."""
        import ray

        # Each bundle is {"CPU": 1} (max_colocate_count=1), so Ray must advertise at least
        # max_n CPUs whatever the machine has; the dashboard is off to spare the 2 cores.
        # On Podium the ping's pooled task worker keeps its CPU: one more for it.
        ray.init(num_cpus=max(max_n, 1) + int(self.on_podium), include_dashboard=False,
                 log_to_driver=False, configure_logging=True, logging_level="ERROR")

        # Podium refuses a task that reserves nothing outside a placement group (an empty
        # bundle): there the ping takes one CPU, which its pooled task worker keeps (above).
        @ray.remote(num_cpus=int(self.on_podium))
        def ping() -> int:
            return 1

        ray.get(ping.remote())

    def make_group(self, worker_cls: type, n: int) -> Any:
        """A RayWorkerGroup of ``n`` actors of ``worker_cls``, one {"CPU": 1} bundle each."""
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.utils.device import get_device_name

        pool = RayResourcePool(process_on_nodes=[n], use_gpu=False, max_colocate_count=1)
        # CPU workers: Podium's group takes "cpu" (as bench.podium_side's); verl's its own name.
        options = {"device_name": "cpu" if self.native else get_device_name()}
        group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(ray.remote(worker_cls)),
                               **options)
        self._pools[id(group)] = pool
        return group

    def destroy_group(self, group: Any) -> None:
        """Kill the group's actors and remove its placement groups (verl has no teardown of its own);
        in native mode, Podium's group shutdown does both."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.native:
            self._pools.pop(id(group), None)
            group.shutdown()
            return
        for worker in group.workers:
            ray.kill(worker, no_restart=True)
        pool = self._pools.pop(id(group), None)
        for pg in (pool.pgs or []) if pool is not None else []:
            remove_placement_group(pg)

    def get_all(self, group: Any, results: list) -> list:
        """ray.get over every ObjectRef of every call (each call returned one list per rank)."""
        import ray

        return ray.get([ref for refs in results for ref in refs])

    def stop(self) -> None:
        """ray.shutdown(): ends the raylet, GCS and workers this process started."""
        import ray

        if ray.is_initialized():
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the Ray child."""
    return run_child(RayAdapter(), argv)


if __name__ == "__main__":
    sys.exit(main())
