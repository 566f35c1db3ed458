"""``podium.timeline`` / ``ray.timeline``: one Chrome trace of the controller and every worker.

The quickstart (real workers, colocated roles) writes its trace; the test reads it as
Perfetto's JSON importer would and checks its structure: every event has ``ph``, ``ts``,
``pid``, ``tid``; durations are non-negative; lanes are named; each group call has one span
per rank, tied to the controller's span of it by its trace id. A second test runs tasks,
actors, puts and a DataProtoFuture read between workers and finds each on the timeline.
"""

from __future__ import annotations

import collections
import json
import re
import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "quickstart.py"


def check_structure(events: list[dict]) -> None:
    assert events, "an empty trace"
    for event in events:
        assert {"ph", "ts", "pid", "tid"} <= set(event), event
        if event["ph"] == "X":
            assert event["dur"] >= 0 and isinstance(event["name"], str), event


@pytest.mark.timeout(240)
def test_the_quickstart_trace_has_one_span_per_rank_for_every_group_call(tmp_path):
    path = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "10", "--timeline", str(path)],
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = json.loads(path.read_text())
    assert isinstance(events, list)
    check_structure(events)
    names = {(e["name"], e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")}
    assert any(n.startswith("controller") for n in names.values())
    assert any(n.startswith("group quickstart") for n in names.values()), names
    assert sum(n.startswith("rank ") for n in names.values()) == 2, names  # one lane per rank

    executed = [e for e in events if e["ph"] == "X" and e["cat"] == "execute" and e["pid"] == 0]
    steps = [e for e in executed if e["name"].endswith("generate_sequences")]
    assert len(steps) == 10, [e["name"] for e in executed]
    calls = collections.defaultdict(list)
    for e in events:
        if e["ph"] == "X" and e["cat"] == "call":
            calls[e["args"]["trace_id"]].append(e)
    for group_call in executed:  # every group call: one span on each of the two ranks
        spans = calls[group_call["args"]["trace_id"]]
        assert sorted(s["tid"] for s in spans) == [0, 1], group_call
        assert all(s["args"]["bytes_in"] > 0 for s in spans)
    runs = [e for e in events if e["ph"] == "X" and e["cat"] == "run"]
    assert len(runs) >= 2 * len(executed)
    assert any(e.get("cat") == "queued" for e in events) and any(e.get("cat") == "reply" for e in events)
    assert any(e["ph"] == "X" and e["cat"] in ("dispatch", "collect") and e["pid"] == 0 for e in events)


class Producer:
    def make(self, n: int):
        import torch
        from podium.dataproto import DataProto
        return DataProto.from_dict(tensors={"x": torch.arange(n)})


class Consumer:
    def total(self, data) -> int:
        return int(data.batch["x"].sum())


@pytest.mark.timeout(240)
def test_tasks_actors_puts_and_future_reads_are_on_the_timeline(tmp_path):
    import podium
    from podium.compat import ray as ray_api

    podium.init(num_cpus=4, log_dir=str(tmp_path / "logs"))
    try:
        @podium.remote
        def square(x: int) -> int:
            return x * x

        assert podium.get([square.remote(i) for i in range(3)]) == [0, 1, 4]
        producer = podium.remote(Producer).remote()
        consumer = podium.remote(Consumer).remote()
        future = producer.make.remote(8)
        assert podium.get(consumer.total.remote(future)) == 28  # the consumer reads it from the producer
        ref = podium.put(list(range(10)))
        assert podium.get(ref) == list(range(10))
        path = tmp_path / "ray-trace.json"
        assert ray_api.timeline(filename=str(path)) is None
        events = json.loads(path.read_text())
        assert events == podium.timeline() or len(podium.timeline()) >= len(events)
    finally:
        podium.shutdown()
    check_structure(events)
    kinds = collections.Counter(e["cat"] for e in events if e["ph"] == "X")
    assert kinds["put"] >= 1 and kinds["get"] >= 3, kinds
    assert kinds["fetch"] >= 1, kinds  # the consumer's read of the producer's result
    worker_calls = {e["name"] for e in events if e["ph"] == "X" and e["cat"] == "call"}
    assert {"make", "total"} <= worker_calls, worker_calls
    assert any(e["ph"] == "X" and e["cat"] == "submit" and e["pid"] == 0 for e in events)


@pytest.mark.timeout(240)
def test_the_slow_step_example_finds_its_straggler(tmp_path):
    example = EXAMPLE.parent / "slow_step.py"
    proc = subprocess.run([sys.executable, str(example), "--timeline", str(tmp_path / "slow.json")],
                          capture_output=True, text=True, timeout=220, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    medians = {int(rank): float(ms) for rank, ms in re.findall(r"rank (\d): +([0-9.]+)", proc.stdout)}
    assert sorted(medians) == [0, 1, 2, 3] and max(medians, key=medians.get) == 2, proc.stdout
    assert "=== group trainer rank 2" in proc.stdout and "in load_batch" in proc.stdout, proc.stdout
    check_structure(json.loads((tmp_path / "slow.json").read_text()))
