"""Application metrics (podium.worker.usermetrics, podium.compat.metrics): what a process
records, the snapshot it leaves for its agent, and how the agent merges the snapshots of its
workers into one Prometheus family each."""

from __future__ import annotations

import json

import pytest

from podium import errors
from podium.worker import usermetrics
from podium.worker.usermetrics import MetricStore, render_dir


def _write(folder, worker: str, pid: int, store: MetricStore) -> None:
    (folder / f"{worker}.{pid}.json").write_text(json.dumps({"worker_id": worker, "pid": pid,
                                                             "families": store.snapshot()}))


def test_snapshots_of_workers_merge_into_one_family_each_and_forgotten_workers_go(tmp_path):
    a, b, c = MetricStore(), MetricStore(), MetricStore()
    for store in (a, b, c):
        store.declare("steps", "counter", "training steps")
        store.declare("lat", "histogram", "latency", [1.0, 2.0])
    a.record("steps", {"phase": "x"}, 2.0, "add")
    b.record("steps", {"phase": "x"}, 3.0, "add")  # a second process of worker w1: added up
    c.record("steps", {"phase": "x"}, 7.0, "add")
    a.record("lat", {}, 1.5, "observe")
    b.record("lat", {}, 0.5, "observe")
    _write(tmp_path, "w1", 10, a)
    _write(tmp_path, "w1", 11, b)
    _write(tmp_path, "w2", 12, c)
    _write(tmp_path, "gone", 13, c)
    lines = render_dir(tmp_path, {"w1", "w2"})
    assert lines.count("# TYPE steps counter") == 1
    assert 'steps{phase="x",worker_id="w1"} 5.0' in lines
    assert 'steps{phase="x",worker_id="w2"} 7.0' in lines
    assert 'lat_bucket{worker_id="w1",le="1.0"} 1' in lines
    assert 'lat_bucket{worker_id="w1",le="+Inf"} 2' in lines
    assert 'lat_count{worker_id="w1"} 2' in lines and 'lat_sum{worker_id="w1"} 2.0' in lines
    assert not (tmp_path / "gone.13.json").exists()
    assert render_dir(tmp_path / "none", {"w1"}) == [] and render_dir(None, {"w1"}) == []


def test_a_family_of_another_kind_in_one_worker_is_skipped_not_mixed(tmp_path):
    a, b = MetricStore(), MetricStore()
    a.declare("m", "counter", "")
    b.declare("m", "gauge", "")
    a.record("m", {}, 1.0, "add")
    b.record("m", {}, 9.0, "set")
    _write(tmp_path, "w1", 1, a)
    _write(tmp_path, "w2", 2, b)
    lines = render_dir(tmp_path, {"w1", "w2"})
    assert lines == ["# HELP m m", "# TYPE m counter", 'm{worker_id="w1"} 1.0']


def test_the_store_bounds_families_and_series_and_refuses_a_redeclared_kind(monkeypatch):
    store = MetricStore()
    store.declare("g", "gauge", "")
    store.declare("g", "gauge", "again")  # the same metric twice, as two Gauge("g") in Ray
    with pytest.raises(errors.InvalidArgumentError, match="already a gauge"):
        store.declare("g", "counter", "")
    with pytest.raises(errors.InvalidArgumentError, match="metric name"):
        store.declare("bad name", "gauge", "")
    monkeypatch.setattr(usermetrics, "MAX_SERIES", 2)
    store.record("g", {"k": "1"}, 1.0, "set")
    store.record("g", {"k": "2"}, 1.0, "set")
    store.record("g", {"k": "2"}, 3.0, "set")  # an existing series is no new one
    with pytest.raises(errors.ResourceExhaustedError, match="at most 2 series"):
        store.record("g", {"k": "3"}, 1.0, "set")
    monkeypatch.setattr(usermetrics, "MAX_FAMILIES", 1)
    with pytest.raises(errors.ResourceExhaustedError, match="at most 1 metrics"):
        store.declare("h", "gauge", "")


def test_a_process_without_the_agents_folder_keeps_its_samples_in_memory(tmp_path, monkeypatch):
    monkeypatch.delenv(usermetrics.DIR_ENV, raising=False)
    store = MetricStore()
    store.declare("c", "counter", "")
    store.record("c", {}, 1.0, "add")
    store.flush()
    assert store.snapshot()["c"]["series"] == [[{}, 1.0]]
    monkeypatch.setenv(usermetrics.DIR_ENV, str(tmp_path))
    monkeypatch.setenv("PODIUM_WORKER_ID", "w9")
    store.flush()
    (written,) = tmp_path.glob("w9.*.json")
    assert json.loads(written.read_text())["families"]["c"]["type"] == "counter"


def test_rays_metric_classes_check_their_arguments_as_ray_does():
    from podium.compat.metrics import Counter, Gauge, Histogram

    counter = Counter("unit_counter", description="d", tag_keys=("a", "b")).set_default_tags({"a": "1"})
    with pytest.raises(ValueError, match="Missing value for tag key"):
        counter.inc()
    with pytest.raises(ValueError, match="Unrecognized tag keys"):
        counter.inc(tags={"b": "2", "c": "3"})
    with pytest.raises(ValueError, match="value must be >0"):
        counter.inc(0, tags={"b": "2"})
    counter.inc(tags={"b": "2"})
    with pytest.raises(TypeError, match="tag_keys should be a tuple"):
        Gauge("unit_gauge", tag_keys="a")
    with pytest.raises(ValueError, match="boundaries argument should be provided"):
        Histogram("unit_hist")
    with pytest.raises(ValueError, match="positive values"):
        Histogram("unit_hist", boundaries=[0.0, 1.0])
    hist = Histogram("unit_hist", boundaries=[1.0, 5.0])
    hist.observe(3.0)
    assert hist.info["boundaries"] == [1.0, 5.0] and counter.info["default_tags"] == {"a": "1"}
    assert usermetrics.STORE.snapshot()["unit_counter"]["series"] == [[{"a": "1", "b": "2"}, 1.0]]
