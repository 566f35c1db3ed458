"""Per-method counters of one worker host: a latency histogram, payload bytes in and out.

Every call the host finishes is recorded under its method name (the constructor under
:data:`CONSTRUCT`): which latency bucket it fell in, its seconds, the bytes of its call
payload and of its reply. The node agent reads them with ``Describe``
(``DescribeResponse.method_stats``) and renders ``podium_method_call_seconds`` and the
``podium_method_*_bytes_total`` counters (:mod:`podium.worker.agent.methodmetrics`).

Cardinality is bounded: the first :data:`MAX_METHODS` distinct names get a row of their
own, every later one is counted under :data:`OTHER` (a method literally named ``other``
shares that row). A name keeps the row it got, so a series never moves between its own
name and ``other``.

Recording is on the hot path of every call: one dict lookup, one bisect, four adds. Two
threads record: the loop and the execution thread (the calls it reads and answers itself,
:mod:`podium.worker.host.directcalls`). Each writes only its own :class:`MethodCounts`, so
no update is lost without a lock per call; they share the :class:`MethodNames` that gives
a new name its row, under a lock, once. :meth:`MethodTable.to_proto` adds both up. These
rows are the host's one book of calls: its per-worker totals are the rows added up
(:mod:`podium.worker.host.completion`).
"""

from __future__ import annotations

import threading
from bisect import bisect_left

from podium.v1 import worker_pb2

__all__ = ["BUCKET_BOUNDS", "CONSTRUCT", "MAX_METHODS", "OTHER", "ROW_IN", "ROW_OUT", "ROW_SUM", "UNRESOLVED",
           "MethodCounts", "MethodNames", "MethodTable"]

#: Upper bounds in seconds of the latency buckets (``le``): Prometheus's defaults (5 ms to
#: 10 s) extended down to 1 ms (a no-op call) and up to 10 minutes (a long RL step). A
#: last bucket, +Inf, follows.
BUCKET_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0, 120.0, 300.0, 600.0)
#: Distinct method names a worker counts under their own name.
MAX_METHODS = 64
#: The row of the calls to methods beyond the first :data:`MAX_METHODS`.
OTHER = "other"
#: The name the constructor (CONSTRUCT) is counted under.
CONSTRUCT = "__init__"
#: The row of the calls that found no method (a misspelt name, a call cancelled unread):
#: counted in the worker's totals, never shown as a row (no method is named "").
UNRESOLVED = ""

# A row: the bucket counts (the last one +Inf), then seconds, bytes in, bytes out.
_BUCKETS = len(BUCKET_BOUNDS) + 1
_SUM, _IN, _OUT = _BUCKETS, _BUCKETS + 1, _BUCKETS + 2
#: Where a row keeps its seconds, bytes in and bytes out (the bucket counts come first).
ROW_SUM, ROW_IN, ROW_OUT = _SUM, _IN, _OUT


class MethodNames:
    """Which names get a row of their own: the first ``limit`` seen (shared by the writers)."""

    def __init__(self, limit: int = MAX_METHODS) -> None:
        self.limit = limit
        self._names: set[str] = set()
        self._lock = threading.Lock()  # two writers may meet a new name at once

    def key(self, method: str) -> str:
        """``method`` if it has (or now gets) a row of its own, else :data:`OTHER`."""
        names = self._names
        if method in names:
            return method
        with self._lock:
            if method in names or len(names) < self.limit:
                names.add(method)
                return method
        return OTHER


class MethodCounts:
    """One writer's rows, by row name (only that thread writes; any thread may read)."""

    __slots__ = ("_names", "rows")

    def __init__(self, names: MethodNames) -> None:
        self._names = names
        #: Row name -> [bucket counts..., seconds, bytes in, bytes out].
        self.rows: dict[str, list] = {}

    def record(self, method: str, seconds: float, bytes_in: int, bytes_out: int, sign: int = 1) -> None:
        """Count one finished call (``sign=-1`` takes back one counted too early)."""
        row = self.rows.get(method)
        if row is None:
            row = self.row(method)
        row[bisect_left(BUCKET_BOUNDS, seconds)] += sign
        row[_SUM] += sign * seconds
        row[_IN] += sign * bytes_in
        row[_OUT] += sign * bytes_out

    def totals(self) -> tuple[int, float, int, int]:
        """Calls, seconds, bytes in and bytes out over every row (read by any thread)."""
        calls, seconds, bytes_in, bytes_out = 0, 0.0, 0, 0
        for row in list(self.rows.values()):
            calls += sum(row[:_BUCKETS])
            seconds += row[_SUM]
            bytes_in += row[_IN]
            bytes_out += row[_OUT]
        return calls, seconds, bytes_in, bytes_out

    def row(self, method: str) -> list:
        """The row ``method`` is counted in (made on first use)."""
        # (A name counted under OTHER is not kept: a name past the bound costs a lock per
        # call, never memory.)
        key = method if method == UNRESOLVED else self._names.key(method)
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = [0] * _BUCKETS + [0.0, 0, 0]
        return row


class MethodTable:
    """A host's per-method counters: the loop's and the execution thread's rows."""

    def __init__(self, limit: int = MAX_METHODS) -> None:
        names = MethodNames(limit)
        #: Written on the event loop only.
        self.loop = MethodCounts(names)
        #: Written by the execution thread only.
        self.thread = MethodCounts(names)

    def to_proto(self) -> list[worker_pb2.MethodStats]:
        """Both writers' rows added up, one message per name, sorted by name."""
        merged: dict[str, list] = {}
        for counts in (self.loop, self.thread):
            # (Copied whole first: the other thread may add a row or a count meanwhile.)
            for name, row in list(counts.rows.items()):
                row = list(row)
                total = merged.get(name)
                if total is None:
                    merged[name] = row
                else:
                    for index, value in enumerate(row):
                        total[index] += value
        out = []
        merged.pop(UNRESOLVED, None)
        for name in sorted(merged):
            row = merged[name]
            buckets = row[:_BUCKETS]
            out.append(worker_pb2.MethodStats(
                name=name, bucket_bounds=BUCKET_BOUNDS, bucket_counts=buckets, count=sum(buckets),
                sum_seconds=row[_SUM], bytes_in=row[_IN], bytes_out=row[_OUT]))
        return out
