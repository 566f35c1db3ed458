"""The per-method counters without a worker: the host's table (podium.worker.host.methodstats)
and the node agent's sums and text (podium.worker.agent.methodmetrics)."""

from __future__ import annotations

import threading

from podium.v1 import worker_pb2
from podium.worker.agent import methodmetrics
from podium.worker.agent.metrics import _labels
from podium.worker.host.methodstats import BUCKET_BOUNDS, OTHER, MethodTable


def _rows(table: MethodTable) -> dict[str, worker_pb2.MethodStats]:
    return {row.name: row for row in table.to_proto()}


def test_a_call_lands_in_the_first_bucket_whose_bound_holds_it():
    table = MethodTable()
    for seconds in (0.0, 0.001, 0.0011, 0.7, 600.0, 601.0):
        table.loop.record("step", seconds, 10, 20)
    row = _rows(table)["step"]
    assert list(row.bucket_bounds) == list(BUCKET_BOUNDS)
    expected = [0] * (len(BUCKET_BOUNDS) + 1)
    for index in (0, 0, 1, BUCKET_BOUNDS.index(1.0), len(BUCKET_BOUNDS) - 1, len(BUCKET_BOUNDS)):
        expected[index] += 1
    assert list(row.bucket_counts) == expected  # le: a call of exactly a bound is in its bucket
    assert row.count == 6 and row.bytes_in == 60 and row.bytes_out == 120
    assert abs(row.sum_seconds - (0.0011 + 0.001 + 0.7 + 1201.0)) < 1e-9


def test_both_writers_add_up_and_a_call_taken_back_leaves_nothing():
    table = MethodTable()
    table.loop.record("a", 0.01, 1, 2)
    table.thread.record("a", 0.01, 1, 2)
    table.thread.record("b", 0.5, 4, 8)
    table.thread.record("b", 0.5, 4, 8, -1)  # counted before a send that did not happen
    rows = _rows(table)
    assert rows["a"].count == 2 and rows["a"].bytes_in == 2 and rows["a"].bytes_out == 4
    assert rows["b"].count == 0 and sum(rows["b"].bucket_counts) == 0 and rows["b"].bytes_out == 0


def test_the_bound_holds_for_both_writers_at_once():
    """Two threads meet 100 new names each at the same time: 8 rows and ``other`` in all."""
    table = MethodTable(limit=8)
    start = threading.Barrier(2)

    def write(counts, prefix):
        start.wait(10)
        for round_ in range(3):
            for i in range(100):
                counts.record(f"{prefix}{i}", 0.001, 1, 1)

    threads = [threading.Thread(target=write, args=(table.loop, "x")),
               threading.Thread(target=write, args=(table.thread, "y"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    rows = _rows(table)
    assert len(rows) == 9 and OTHER in rows
    assert sum(row.count for row in rows.values()) == 600
    assert all(row.count == 3 for name, row in rows.items() if name != OTHER)  # a name keeps its row


def _stats(name, counts, seconds=1.0, bytes_in=0, bytes_out=0, bounds=(0.1, 1.0)):
    return worker_pb2.MethodStats(name=name, bucket_bounds=bounds, bucket_counts=counts, count=sum(counts),
                                  sum_seconds=seconds, bytes_in=bytes_in, bytes_out=bytes_out)


def _render(totals) -> list[str]:
    lines: list[str] = []

    def family(name, kind, text):
        lines.append(f"# TYPE {name} {kind}")

    methodmetrics.render_methods(totals, "n1", family, _labels, lines)
    return lines


def test_ranks_of_a_group_are_summed_into_one_cumulative_histogram():
    totals = methodmetrics.MethodTotals()
    totals.add("actor", [_stats("step", [1, 2, 0], 2.5, 100, 10)])
    totals.add("actor", [_stats("step", [0, 1, 1], 3.0, 50, 5), _stats("init", [1, 0, 0])])
    totals.add("critic", [_stats("step", [0, 0, 4], 9.0)])
    lines = _render(totals)
    who = 'node="n1",group="actor",method="step"'
    for sample in (f'podium_method_call_seconds_bucket{{{who},le="0.1"}} 1',
                   f'podium_method_call_seconds_bucket{{{who},le="1.0"}} 4',
                   f'podium_method_call_seconds_bucket{{{who},le="+Inf"}} 5',
                   f"podium_method_call_seconds_sum{{{who}}} 5.5",
                   f"podium_method_call_seconds_count{{{who}}} 5",
                   f"podium_method_received_bytes_total{{{who}}} 150",
                   f"podium_method_sent_bytes_total{{{who}}} 15",
                   'podium_method_call_seconds_count{node="n1",group="critic",method="step"} 4'):
        assert sample in lines, sample
    assert "# TYPE podium_method_call_seconds histogram" in lines
    assert sum(1 for line in lines if line.startswith("podium_method_call_seconds_count")) == 3


def test_a_group_keeps_the_bound_and_skips_rows_it_cannot_add():
    totals = methodmetrics.MethodTotals(limit=2)
    totals.add("g", [_stats("a", [1, 0, 0]), _stats("b", [1, 0, 0]), _stats(OTHER, [0, 1, 0])])
    totals.add("g", [_stats("c", [0, 0, 1]), _stats("a", [1, 0, 0, 0], bounds=(0.1, 1.0, 2.0))])
    totals.add("g", [_stats("b", [5, 5])])  # a bucket short: skipped
    rows = {method: t for _, method, t in totals.rows()}
    assert set(rows) == {"a", "b", OTHER}
    assert rows["a"].buckets == [1, 0, 0]  # the row with other bounds is left out
    assert rows["b"].buckets == [1, 0, 0]
    assert rows[OTHER].buckets == [0, 1, 1]  # "other" of a worker and "c", past the group's bound
