"""``podium status`` as text: the scheduler's ClusterState rendered as plain tables.

Four tables: nodes, GPUs (with the bundles and workers on each), placement groups,
workers. Pure (no I/O), so it is tested without a cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from podium.v1 import common_pb2, scheduler_pb2

__all__ = ["render_status", "table", "human_bytes"]

_LIVE = (common_pb2.WORKER_STARTING, common_pb2.WORKER_RUNNING)


def human_bytes(n: int) -> str:
    """1536 -> '1.5KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{n}B"  # pragma: no cover


def table(headers: list[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces; '(none)' under the header when empty."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    if not cells:
        lines.append("(none)")
    return "\n".join(lines)


def _fraction(value: float) -> str:
    frac = Fraction(value).limit_denominator(1000)
    return str(frac)


def _restarts(spec: common_pb2.WorkerSpec) -> str:
    """An actor's restarts so far and its max_restarts ("2/5", "20/inf"); "-" for a worker that
    is never restarted."""
    if not spec.max_restarts:
        return "-"
    return f"{spec.restarts}/{'inf' if spec.max_restarts < 0 else spec.max_restarts}"


def render_status(state: scheduler_pb2.ClusterState, *, all_workers: bool = False) -> str:
    """The readable status of a cluster (ended workers only with ``all_workers``)."""
    nodes = sorted(state.nodes, key=lambda n: n.info.node_id)
    groups = {g.id: g for g in state.placement_groups if g.state != common_pb2.PG_REMOVED}
    workers = [w for w in state.workers if all_workers or w.state in _LIVE]
    workers.sort(key=lambda w: (w.spec.group, w.spec.rank, w.spec.name))
    node_rows, gpu_rows = [], []
    for node in nodes:
        info = node.info
        owners: dict[int, list[str]] = {}
        reserved: dict[int, Fraction] = {}
        for group in groups.values():
            if group.state != common_pb2.PG_CREATED:
                continue
            for placed in group.placements:
                if placed.node_id != info.node_id:
                    continue
                share = Fraction(group.bundles[placed.bundle_index].resources.get("GPU", 0.0)
                                 ).limit_denominator(1000)
                for index in placed.gpu_indices:
                    owners.setdefault(index, []).append(f"{group.name or group.id}[{placed.bundle_index}]")
                    reserved[index] = reserved.get(index, Fraction(0)) + min(share, Fraction(1))
        on_gpu: dict[int, list[str]] = {}
        for w in workers:
            if w.node_id == info.node_id and w.state in _LIVE:
                for index in w.gpu_indices:
                    on_gpu.setdefault(index, []).append(
                        f"{w.spec.name or w.id} ({_fraction(w.spec.num_gpus)})")
        busy = sum(1 for g in info.gpus if reserved.get(g.index))
        node_rows.append([info.node_id, f"{info.address}:{info.agent_port}",
                          common_pb2.NodeState.Name(node.state).removeprefix("NODE_"),
                          f"{busy}/{len(info.gpus)}", f"{info.cpus:g}",
                          sum(1 for w in workers if w.node_id == info.node_id and w.state in _LIVE)])
        for gpu in sorted(info.gpus, key=lambda g: g.index):
            gpu_rows.append([info.node_id, gpu.index, gpu.name,
                             f"{human_bytes(gpu.memory_used_bytes)}/{human_bytes(gpu.memory_total_bytes)}",
                             str(reserved.get(gpu.index, 0)), ", ".join(owners.get(gpu.index, [])) or "-",
                             ", ".join(on_gpu.get(gpu.index, [])) or "-"])
    pg_rows = [[g.name or "-", g.id, common_pb2.PlacementGroupState.Name(g.state).removeprefix("PG_"),
                common_pb2.Strategy.Name(g.strategy), len(g.bundles),
                ",".join(sorted({p.node_address for p in g.placements})) or "-",
                "detached" if g.detached else (g.owner or "-")]
               for g in sorted(groups.values(), key=lambda g: (g.name, g.id))]
    worker_rows = [[w.spec.name or "-", w.id, w.spec.group or "-", w.spec.rank,
                    common_pb2.WorkerState.Name(w.state).removeprefix("WORKER_"), w.node_address or "-",
                    ",".join(map(str, w.gpu_indices)) or "-", _fraction(w.spec.num_gpus),
                    w.pid or "-", w.port or "-", _restarts(w.spec)] for w in workers]
    alive = sum(1 for n in nodes if n.state == common_pb2.NODE_ALIVE)
    gpus = sum(len(n.info.gpus) for n in nodes)
    return "\n\n".join([
        f"scheduler {state.scheduler_id}: {alive}/{len(nodes)} nodes alive, {gpus} GPUs, "
        f"{len(groups)} placement groups, {len(workers)} workers",
        "NODES\n" + table(["NODE", "AGENT", "STATE", "GPUS USED", "CPUS", "WORKERS"], node_rows),
        "GPUS\n" + table(["NODE", "GPU", "NAME", "MEMORY", "RESERVED", "BUNDLES", "WORKERS (FRACTION)"],
                         gpu_rows),
        "PLACEMENT GROUPS\n" + table(["NAME", "ID", "STATE", "STRATEGY", "BUNDLES", "NODES", "OWNER"],
                                     pg_rows),
        "WORKERS\n" + table(["NAME", "ID", "GROUP", "RANK", "STATE", "NODE", "GPU", "FRACTION", "PID",
                             "PORT", "RESTARTS"], worker_rows),
    ])
