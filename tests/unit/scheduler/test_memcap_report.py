"""How a worker's GPU memory cap report travels: the worker's ready line -> the agent
(spawner) -> the scheduler (ReportWorker on RUNNING, RunningWorker on every heartbeat and
re-registration) -> /v1/placement beside what was asked. Pure parts, no sockets."""

from __future__ import annotations

import json

import pytest

from podium import memcap
from podium.scheduler.http import placement_view
from podium.scheduler.state import ClusterModel
from podium.v1 import common_pb2, scheduler_pb2
from podium.worker.agent import managed

GIB = 1 << 30


def _model() -> ClusterModel:
    model = ClusterModel(node_lease=10, default_session_lease=30)
    model.register_node(common_pb2.NodeInfo(
        node_id="node-2", address="10.0.0.2", agent_port=7002, cpus=16,
        gpus=[common_pb2.GpuInfo(index=0, uuid="GPU-2-0", memory_total_bytes=80 * GIB)]), [], now=0)
    return model


def _worker(model: ClusterModel, env: dict[str, str]) -> common_pb2.WorkerInfo:
    pg = model.create_placement_group("p", [{"CPU": 3, "GPU": 1}], 1, False, "", now=0)
    spec = common_pb2.WorkerSpec(name="w0", group="g", placement_group_id=pg.id, bundle_index=0,
                                 num_gpus=1 / 3, num_cpus=1, rank=0, world_size=1, env=env)
    [worker] = model.create_workers([spec], "", 0, 1, now=0)
    model.mark_spawned(worker.id, 11, "/log/w0")
    return worker


def _cap_in_placement(model: ClusterModel) -> dict | None:
    [node] = placement_view(model)["nodes"]
    [worker] = node["gpus"][0]["workers"]
    return worker["memory_cap"]


def _report(applied: bool, cap_bytes: int = 0) -> common_pb2.GpuMemoryCap:
    return common_pb2.GpuMemoryCap(fraction=1 / 3, applied=applied, cap_bytes=cap_bytes,
                                   detail="applied: cuda:0" if applied else "not applied: no CUDA")


def test_asked_then_reported_on_running():
    model = _model()
    worker = _worker(model, memcap.cap_env("fraction", 3))
    assert _cap_in_placement(model) == {"fraction": pytest.approx(1 / 3), "bytes": int(80 * GIB / 3),
                                        "text": "1/3", "applied": None, "detail": "not reported yet"}
    model.report_worker(scheduler_pb2.ReportWorkerRequest(
        worker_id=worker.id, state=common_pb2.WORKER_RUNNING, pid=11, port=9000, node_id="node-2",
        gpu_memory_cap=_report(True, 26 * GIB)), now=1)
    cap = _cap_in_placement(model)
    # The worker's own limit (torch's total, a little below NVML's) replaces the estimate.
    assert (cap["applied"], cap["bytes"], cap["detail"]) == (True, 26 * GIB, "applied: cuda:0")


def test_heartbeat_and_reregistration_carry_the_report():
    model = _model()
    worker = _worker(model, memcap.cap_env("fraction", 3))
    running = [scheduler_pb2.RunningWorker(worker_id=worker.id, pid=11, port=9000,
                                           gpu_memory_cap=_report(False))]
    model.take_dirty()
    model.heartbeat("node-2", [], [], running, now=1)
    assert _cap_in_placement(model)["applied"] is False
    assert worker.id in model.take_dirty().workers  # persisted once
    model.heartbeat("node-2", [], [], running, now=2)
    assert worker.id not in model.take_dirty().workers  # unchanged: nothing to write
    model.register_node(model.nodes["node-2"].info, [scheduler_pb2.RunningWorker(
        worker_id=worker.id, pid=11, port=9000, gpu_memory_cap=_report(True, 20 * GIB))], now=3)
    assert _cap_in_placement(model)["bytes"] == 20 * GIB


def test_no_cap_asked_is_none_even_with_a_stray_report():
    model = _model()
    worker = _worker(model, {})
    model.heartbeat("node-2", [], [], [scheduler_pb2.RunningWorker(worker_id=worker.id, pid=11, port=9000)],
                    now=1)
    assert _cap_in_placement(model) is None and not worker.HasField("gpu_memory_cap")


@pytest.mark.parametrize("line, expected", [
    (b'{"port": 5}\n', None),
    (json.dumps({"port": 5, "gpu_memory_cap": memcap.CapReport(
        requested=True, fraction=0.5, detail="not applied: no CUDA").ready_fields()}).encode(),
     common_pb2.GpuMemoryCap(fraction=0.5, detail="not applied: no CUDA")),
    (b'{"port": 5, "gpu_memory_cap": {"nope": 1}}', None),       # unknown field: dropped
    (b'{"port": 5, "gpu_memory_cap": {"bytes": -1}}', None),     # out of range: dropped
    (b'{"port": 5, "gpu_memory_cap": "lots"}', None),
])
def test_ready_line_cap(line, expected):
    assert managed.parse_ready(line) == (5, "")  # the cap never spoils a good ready line
    assert managed.ready_cap(line) == expected
