"""Tables and JSON lines from the cells the backend children measured.

A cell is one number for one (measure, N, payload) on one backend, or an error. This module
pairs the Podium and Ray cells of each key, computes the ratio Podium/Ray, and renders one
table per measure (rows: N, plus payload for throughput) and one JSON line per key.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable

# measure -> (title, unit, which direction is better, number format)
MEASURES: dict[str, tuple[str, str, str, str]] = {
    "cluster_start_s": ("cluster start: ray.init() / podium init() returned (untimed by cold start)", "s",
                        "lower", "{:.2f}"),
    "cold_start_s": ("cold start: WorkerGroup constructed -> first ONE_TO_ALL returned", "s", "lower", "{:.2f}"),
    "cold_start_torch_s": ("cold start, worker imports torch in __init__ (as a training worker does)", "s",
                           "lower", "{:.2f}"),
    "noop_latency_median_ms": ("no-op ONE_TO_ALL latency, median", "ms", "lower", "{:.3f}"),
    "noop_latency_p90_ms": ("no-op ONE_TO_ALL latency, p90", "ms", "lower", "{:.3f}"),
    "noop_controller_cpu_ms": ("controller CPU time per no-op ONE_TO_ALL call (all its threads)", "ms",
                               "lower", "{:.3f}"),
    "noop_workers_cpu_ms": ("worker CPU time per no-op ONE_TO_ALL call, all ranks together", "ms", "lower",
                            "{:.3f}"),
    "noop_controller_us_per_rank": ("controller CPU per rank per no-op ONE_TO_ALL call", "us", "lower", "{:.1f}"),
    "noop_workers_us_per_rank": ("worker CPU per rank per no-op ONE_TO_ALL call", "us", "lower", "{:.1f}"),
    "worker_pss_mib": ("memory per worker: PSS, mean over ranks, after the DP_COMPUTE_PROTO step", "MiB",
                       "lower", "{:.1f}"),
    "dp_proto_mb_s": ("DP_COMPUTE_PROTO round trip, float32 batch, payload counted both ways (MB = 10^6 B)",
                      "MB/s", "higher", "{:,.0f}"),
    "nonblocking_calls_s": ("non-blocking ONE_TO_ALL group calls per second", "calls/s", "higher", "{:,.0f}"),
    "pipelined_rank_calls_s": ("non-blocking ONE_TO_ALL calls in flight from one controller, rank-calls per second",
                               "rank-calls/s", "higher", "{:,.0f}"),
}
#: The cells ``python -m bench.scale`` measures without a framework (bench.floors.fanout), as
#: the backend "floor": a column of their own, and Podium's value over theirs.
FLOOR = "floor"

#: "verl-podium" / "verl-native": verl's own RayWorkerGroup code under ``podium run`` (Ray mode)
#: and ``podium run --native-verl``; not run unless asked for with --backends.
BACKENDS = ("podium", "ray", "verl-podium", "verl-native")
# Keys a cell shares with its JSON line; the rest (samples, breakdown, ...) go under <backend>_detail.
_COMMON_KEYS = {"backend", "measure", "n", "payload_mib", "value", "unit", "error"}


def cell_key(cell: dict) -> tuple:
    """(measure, n, payload_mib or None): what a Podium cell and a Ray cell share."""
    return (cell["measure"], cell.get("n"), cell.get("payload_mib"))


def ratio(podium: dict | None, ray: dict | None) -> float | None:
    """Podium value / Ray value, or None where either side has no number."""
    values = [c.get("value") if c and not c.get("error") else None for c in (podium, ray)]
    if values[0] is None or values[1] is None or not values[1]:
        return None
    return values[0] / values[1]


def pair_cells(cells: Iterable[dict]) -> dict[tuple, dict[str, dict]]:
    """Group cells by key: {key: {backend: cell}} (later cells of the same key win)."""
    paired: dict[tuple, dict[str, dict]] = {}
    for cell in cells:
        if cell.get("measure") not in MEASURES:
            continue
        paired.setdefault(cell_key(cell), {})[cell["backend"]] = cell
    return paired


def json_lines(paired: dict[tuple, dict[str, dict]]) -> list[str]:
    """One JSON object per key: both values, errors, the ratio, which direction is better, and
    each backend's samples and breakdown under ``<backend>_detail``."""
    lines = []
    for (measure, n, mib), by_backend in sorted(paired.items(), key=_sort_key):
        _, unit, better, _ = MEASURES[measure]
        record: dict[str, Any] = {"measure": measure, "n": n, "unit": unit, "better": better}
        if mib is not None:
            record["payload_mib"] = mib
        for backend in BACKENDS:
            cell = by_backend.get(backend)
            if cell is None:
                continue
            record[backend] = None if cell.get("error") else cell.get("value")
            detail = {k: v for k, v in cell.items() if k not in _COMMON_KEYS}
            if detail:
                record[f"{backend}_detail"] = detail
            if cell.get("error"):
                record[f"{backend}_error"] = cell["error"]
        r = ratio(by_backend.get("podium"), by_backend.get("ray"))
        record["ratio_podium_over_ray"] = None if r is None else round(r, 4)
        if FLOOR in by_backend:
            cell = by_backend[FLOOR]
            record[FLOOR] = None if cell.get("error") else cell.get("value")
            record[f"{FLOOR}_detail"] = {k: v for k, v in cell.items() if k not in _COMMON_KEYS}
            r = ratio(by_backend.get("podium"), cell)
            record["ratio_podium_over_floor"] = None if r is None else round(r, 4)
        lines.append(json.dumps(record, sort_keys=True))
    return lines


def _sort_key(item: tuple) -> tuple:
    (measure, n, mib), _ = item
    return (list(MEASURES).index(measure), mib or 0, n or 0)


def _show(cell: dict | None, fmt: str) -> str:
    if cell is None:
        return "-"
    if cell.get("error"):
        return "error"
    value = cell.get("value")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def tables(paired: dict[tuple, dict[str, dict]], backends: Iterable[str] = BACKENDS) -> str:
    """One plain-text table per measure; cell errors are listed under their table."""
    backends = [b for b in BACKENDS if b in set(backends)]
    out: list[str] = []
    for measure, (title, unit, better, fmt) in MEASURES.items():
        rows = sorted(((k, v) for k, v in paired.items() if k[0] == measure), key=_sort_key)
        if not rows:
            continue
        has_payload = any(k[2] is not None for k, _ in rows)
        header = ["payload MiB"] if has_payload else []
        header += ["N"] + [f"{b} ({unit})" for b in backends]
        versus_ray = "podium" in backends and "ray" in backends
        if versus_ray:
            header.append(f"podium/ray ({better} is better)")
        floors = any(FLOOR in v for _, v in rows)
        if floors:
            kind = next(v[FLOOR].get("kind", "") for _, v in rows if FLOOR in v)
            header += [f"floor: {kind} ({unit})", "podium/floor"]
        body, errors = [], []
        for (_, n, mib), by_backend in rows:
            row = [str(mib)] if has_payload else []
            row += [str(n)] + [_show(by_backend.get(b), fmt) for b in backends]
            pairs = ([("ray", by_backend.get("ray"))] if versus_ray else []) + \
                ([(FLOOR, by_backend.get(FLOOR))] if floors else [])
            for name, other in pairs:
                if name == FLOOR:
                    row.append(_show(other, fmt))
                r = ratio(by_backend.get("podium"), other)
                row.append("-" if r is None else f"{r:.2f}x")
            body.append(row)
            for b in [*backends, FLOOR]:
                cell = by_backend.get(b)
                if cell and cell.get("error"):
                    where = f"N={n}" + (f", {mib} MiB" if mib is not None else "")
                    errors.append(f"  {b} {where}: {cell['error']}")
        out.append(f"## {title}")
        out.append(_render(header, body))
        out.extend(errors)
        out.append("")
    return "\n".join(out)


def breakdown_table(cells: Iterable[dict]) -> str:
    """Where cold start went, per backend and N: seconds after WorkerGroup construction began
    at which the latest rank reached each phase (a negative process start means the backend
    handed out a process started before the group was asked for)."""
    header = ["measure", "backend", "N", "process started", "serving", "object constructed", "constructor returned",
              "first call ran", "first call returned", "backend stamps"]
    body = []
    for cell in sorted(cells, key=lambda c: (c.get("measure", ""), c.get("backend", ""), c.get("n") or 0)):
        if not str(cell.get("measure")).startswith("cold_start") or cell.get("error") or not cell.get("breakdown"):
            continue
        b = cell["breakdown"]

        def at(key: str) -> str:
            return f"{b[key]:.3f}" if isinstance(b.get(key), (int, float)) else "-"

        env = sorted((b.get("env") or {}).items(), key=lambda kv: kv[1])
        stamps = ", ".join(f"{_short(k)} {v:.3f}" for k, v in env) or "-"
        body.append([cell["measure"], cell["backend"], str(cell["n"]), at("worker_process_started"), at("worker_serving"),
                     at("worker_constructed"),
                     at("constructor_returned"), at("worker_first_call"), at("first_call_returned"), stamps])
    if not body:
        return ""
    return ("## cold start breakdown (seconds after WorkerGroup construction began, latest rank)\n"
            + _render(header, body) + "\n")


def _short(env_key: str) -> str:
    """PODIUM_SPAWN_REQUESTED_AT -> spawn_requested."""
    key = env_key.removeprefix("PODIUM_")
    return key.removesuffix("_AT").lower()


def _render(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |" for row in body]
    return "\n".join(lines)


def cells_from_json_lines(lines: Iterable[str]) -> list[dict]:
    """Cells back from the JSON lines of a saved run (``python -m bench --from-json PATH``)."""
    cells = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        for backend in BACKENDS:
            if backend not in record and f"{backend}_error" not in record:
                continue
            cell = {"backend": backend, "measure": record["measure"], "n": record.get("n"),
                    "unit": record.get("unit"), **record.get(f"{backend}_detail", {})}
            if record.get("payload_mib") is not None:
                cell["payload_mib"] = record["payload_mib"]
            if record.get(f"{backend}_error"):
                cell["error"] = record[f"{backend}_error"]
            else:
                cell["value"] = record.get(backend)
            cells.append(cell)
    return cells
