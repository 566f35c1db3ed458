"""The free capacity of a live cluster as a scheduling-core Snapshot.

The controller asks the scheduler for its ``ClusterState`` and rebuilds what is free on
each alive node (total minus every placement group's reserved bundles), so that a
trainer's pools can be checked together, node by node, with the scheduler's own
placement algorithm before any process starts.
"""

from __future__ import annotations

from typing import Any

from podium.resources import GPU_UNITS, cpu_units, gpu_units
from podium.scheduler.core import GpuView, NodeView, Snapshot

__all__ = ["snapshot_of"]


def snapshot_of(state: Any) -> Snapshot:
    """A Snapshot of the alive nodes of ``state`` (a podium.v1 ClusterState) with free amounts."""
    from podium.v1 import common_pb2

    free_cpu: dict[str, int] = {}
    free_gpu: dict[str, dict[int, int]] = {}
    for status in state.nodes:
        if status.state != common_pb2.NODE_ALIVE:
            continue
        info = status.info
        free_cpu[info.node_id] = cpu_units(info.cpus)
        free_gpu[info.node_id] = {g.index: GPU_UNITS for g in info.gpus}
    for pg in state.placement_groups:
        if pg.state == common_pb2.PG_REMOVED:
            continue
        for placement in pg.placements:
            node = placement.node_id
            if node not in free_cpu:
                continue
            resources = pg.bundles[placement.bundle_index].resources
            free_cpu[node] -= cpu_units(resources.get("CPU", 0.0))
            gpus = resources.get("GPU", 0.0)
            if gpus:
                per_gpu = gpu_units(gpus) if gpus < 1 else GPU_UNITS
                for index in placement.gpu_indices:
                    free_gpu[node][index] = free_gpu[node].get(index, GPU_UNITS) - per_gpu
    nodes = []
    for status in state.nodes:
        info = status.info
        if info.node_id not in free_cpu:
            continue
        nodes.append(NodeView(
            node_id=info.node_id, address=info.address, total_cpu_units=cpu_units(info.cpus),
            free_cpu_units=max(0, free_cpu[info.node_id]),
            gpus=tuple(GpuView(index=g.index, uuid=g.uuid,
                               free_units=max(0, free_gpu[info.node_id][g.index]),
                               memory_total_bytes=g.memory_total_bytes) for g in info.gpus)))
    return Snapshot(tuple(nodes))
