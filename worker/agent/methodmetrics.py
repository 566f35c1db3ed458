"""The per-method families of the node agent's ``/metrics``: each worker host's
``DescribeResponse.method_stats`` (:mod:`podium.worker.host.methodstats`) added up over the
node's workers of the same group and method.

Ranks are summed, so a node's series are groups x methods, never ranks: a straggler shows
in ``podium status`` and the timeline, not here. A worker already counts at most
``MAX_METHODS`` names; a group keeps that bound here too (names past it, in name order, go
to ``other``), since the ranks of one group could each have seen different names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from podium.v1 import worker_pb2
from podium.worker.host.methodstats import MAX_METHODS, OTHER

__all__ = ["FAMILIES", "MethodTotals", "render_methods"]

log = logging.getLogger(__name__)

#: The families this module writes: name -> (type, help).
FAMILIES = {
    "podium_method_call_seconds": ("histogram", "seconds per call, by group and method (the node's ranks summed)"),
    "podium_method_received_bytes_total": ("counter", "call payload bytes received, by group and method"),
    "podium_method_sent_bytes_total": ("counter", "reply payload bytes sent, by group and method"),
}


class _Totals:
    """One (group, method)'s sums."""

    __slots__ = ("bounds", "buckets", "seconds", "bytes_in", "bytes_out")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)
        self.seconds = 0.0
        self.bytes_in = 0
        self.bytes_out = 0

    def add(self, stats: worker_pb2.MethodStats) -> None:
        for index, count in enumerate(stats.bucket_counts):
            self.buckets[index] += count
        self.seconds += stats.sum_seconds
        self.bytes_in += stats.bytes_in
        self.bytes_out += stats.bytes_out


class MethodTotals:
    """The method stats of one scrape's workers, summed by (group, method)."""

    def __init__(self, limit: int = MAX_METHODS) -> None:
        self.limit = limit
        self._groups: dict[str, dict[str, list[worker_pb2.MethodStats]]] = {}

    def add(self, group: str, method_stats: Iterable[worker_pb2.MethodStats]) -> None:
        """Take one worker's ``method_stats``."""
        methods = self._groups.setdefault(group, {})
        for stats in method_stats:
            methods.setdefault(stats.name, []).append(stats)

    def rows(self) -> list[tuple[str, str, _Totals]]:
        """(group, method, totals), sorted; at most ``limit`` names and ``other`` per group."""
        out = []
        for group in sorted(self._groups):
            methods = self._groups[group]
            names = sorted(methods)
            kept = [name for name in names if name != OTHER][:self.limit]
            folded = [name for name in names if name not in kept]
            merged = {name: methods[name] for name in kept}
            if folded:
                merged[OTHER] = [stats for name in folded for stats in methods[name]]
            for name in sorted(merged):
                totals = self._sum(group, name, merged[name])
                if totals is not None:
                    out.append((group, name, totals))
        return out

    @staticmethod
    def _sum(group: str, name: str, rows: list[worker_pb2.MethodStats]) -> _Totals | None:
        totals: _Totals | None = None
        for stats in rows:
            bounds = tuple(stats.bucket_bounds)
            if len(stats.bucket_counts) != len(bounds) + 1:
                log.debug("metrics: method %s of group %s has %d buckets for %d bounds; skipped",
                          name, group, len(stats.bucket_counts), len(bounds))
                continue
            if totals is None:
                totals = _Totals(bounds)
            elif bounds != totals.bounds:  # workers of another Podium version: not addable
                log.debug("metrics: method %s of group %s: bucket bounds differ between workers; "
                          "one worker skipped", name, group)
                continue
            totals.add(stats)
        return totals


def render_methods(totals: MethodTotals, node: str, family: Callable[[str, str, str], None],
                   labels: Callable[[dict], str], lines: list[str]) -> None:
    """Append the per-method families to ``lines`` (``family`` writes HELP and TYPE,
    ``labels`` a label set, as :func:`podium.worker.agent.metrics.render` does)."""
    rows = totals.rows()
    name = "podium_method_call_seconds"
    family(name, FAMILIES[name][0], FAMILIES[name][1])
    for group, method, t in rows:
        who = {"node": node, "group": group, "method": method}
        cumulative = 0
        for bound, count in zip((*(repr(float(b)) for b in t.bounds), "+Inf"), t.buckets):
            cumulative += count
            lines.append(f"{name}_bucket{labels({**who, 'le': bound})} {cumulative}")
        lines.append(f"{name}_sum{labels(who)} {t.seconds!r}")
        lines.append(f"{name}_count{labels(who)} {cumulative}")
    for name, attr in (("podium_method_received_bytes_total", "bytes_in"),
                       ("podium_method_sent_bytes_total", "bytes_out")):
        family(name, FAMILIES[name][0], FAMILIES[name][1])
        for group, method, t in rows:
            lines.append(f"{name}{labels({'node': node, 'group': group, 'method': method})} {getattr(t, attr)}")
