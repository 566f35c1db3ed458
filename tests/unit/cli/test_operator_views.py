"""Pure pieces of the operator features: status tables, progress lines, log-to-driver filtering."""

from __future__ import annotations

import asyncio
import io

from podium.controller.session.logdriver import is_internal_line, log_to_driver_enabled
from podium.controller.session.progress import Progress
from podium.cli.status_table import human_bytes, render_status, table
from podium.v1 import common_pb2, scheduler_pb2
from tests.support.waiting import eventually_async


def _state() -> scheduler_pb2.ClusterState:
    gpus = [common_pb2.GpuInfo(index=i, uuid=f"GPU-{i}", name="Fake GPU", memory_total_bytes=80 << 30,
                               memory_used_bytes=(1 << 30) * i) for i in range(2)]
    node = common_pb2.NodeStatus(
        info=common_pb2.NodeInfo(node_id="n1", address="127.0.0.2", agent_port=7000, cpus=16, gpus=gpus),
        state=common_pb2.NODE_ALIVE)
    pg = common_pb2.PlacementGroup(
        id="pg-1", name="train", state=common_pb2.PG_CREATED, strategy=common_pb2.STRICT_PACK,
        bundles=[common_pb2.Bundle(resources={"CPU": 2, "GPU": 1})],
        placements=[common_pb2.BundlePlacement(bundle_index=0, node_id="n1", node_address="127.0.0.2",
                                               gpu_indices=[1])])
    workers = [common_pb2.WorkerInfo(
        id=f"w-{r}", spec=common_pb2.WorkerSpec(name=f"actor_{r}", group="g", rank=r, num_gpus=0.5,
                                                placement_group_id="pg-1"),
        node_id="n1", node_address="127.0.0.2", state=common_pb2.WORKER_RUNNING, pid=100 + r,
        port=9000 + r, gpu_indices=[1]) for r in range(2)]
    workers.append(common_pb2.WorkerInfo(id="w-old", spec=common_pb2.WorkerSpec(name="gone"),
                                         state=common_pb2.WORKER_EXITED))
    return scheduler_pb2.ClusterState(scheduler_id="s1", nodes=[node], placement_groups=[pg],
                                      workers=workers)


def test_status_renders_every_section():
    text = render_status(_state())
    assert text.startswith("scheduler s1: 1/1 nodes alive, 2 GPUs, 1 placement groups, 2 workers")
    gpu1 = next(line for line in text.splitlines() if line.startswith("n1") and " 1 " in line[:20])
    assert "train[0]" in gpu1 and "actor_0 (1/2)" in gpu1 and "actor_1 (1/2)" in gpu1
    assert "1.0GiB/80.0GiB" in gpu1
    assert "STRICT_PACK" in text and "RUNNING" in text
    assert "gone" not in text
    assert "gone" in render_status(_state(), all_workers=True)


def test_table_and_bytes():
    assert table(["A", "BB"], []) == "A  BB\n(none)"
    assert table(["A", "B"], [["xyz", 1]]).splitlines() == ["A    B", "xyz  1"]
    assert human_bytes(512) == "512B" and human_bytes(1536) == "1.5KiB"


def test_internal_lines_are_filtered_user_lines_are_not():
    assert is_internal_line("2026-11-30 09:30:01,123 rank1 INFO podium.worker.host: worker x serving")
    assert not is_internal_line("2026-11-30 09:30:01,123 rank1 WARNING podium.worker.host: slow")
    assert not is_internal_line("hello from rank 1")
    assert not is_internal_line("2026-11-30 09:30:01,123 rank1 INFO mylib: loaded")


def test_log_to_driver_setting(monkeypatch):
    monkeypatch.delenv("PODIUM_LOG_TO_DRIVER", raising=False)
    assert log_to_driver_enabled() is True
    monkeypatch.setenv("PODIUM_LOG_TO_DRIVER", "0")
    assert log_to_driver_enabled() is False
    assert log_to_driver_enabled(True) is True
    monkeypatch.setenv("PODIUM_LOG_TO_DRIVER", "1")
    assert log_to_driver_enabled(False) is False


def test_progress_is_silent_when_quick_and_reports_phases_when_late():
    async def scenario():
        quick = io.StringIO()
        p = Progress("op", after=60, stream=quick)
        p.phase("one")
        p.done()
        slow = io.StringIO()
        p = Progress("op", after=0.05, stream=slow)
        p.count_interval = 3600.0  # count updates never print here, however slow the machine
        p.phase("starting 2 workers")
        await eventually_async(lambda: "starting 2 workers" in slow.getvalue(), "the timer to print the phase")
        p.phase("1/2 constructed", count=True)  # within count_interval of the last line: held back
        p.phase("connecting")
        p.done("ready")
        p.phase("after done")
        return quick.getvalue(), slow.getvalue()

    quick, slow = asyncio.run(scenario())
    assert quick == ""
    lines = slow.splitlines()
    assert [line.split(": ", 2)[2].rsplit(" (", 1)[0] for line in lines] == [
        "starting 2 workers", "connecting", "ready"]
    assert all(line.startswith("podium: op: ") for line in lines)


def test_status_shows_actor_restarts():
    state = _state()
    state.workers[0].spec.max_restarts = -1
    state.workers[0].spec.restarts = 20
    state.workers[1].spec.max_restarts = 2
    state.workers[1].spec.restarts = 1
    lines = render_status(state).splitlines()
    header = next(line for line in lines if line.startswith("NAME") and "RESTARTS" in line)
    assert header.split()[-1] == "RESTARTS"
    assert next(line for line in lines if line.startswith("actor_0 ")).split()[-1] == "20/inf"
    assert next(line for line in lines if line.startswith("actor_1 ")).split()[-1] == "1/2"
    plain = render_status(_state()).splitlines()
    assert next(line for line in plain if line.startswith("actor_0 ")).split()[-1] == "-"
