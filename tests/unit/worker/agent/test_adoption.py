"""A restarted agent re-adopts a worker by pid *and* start time, from the record it left."""

from __future__ import annotations

import asyncio
import os
import pathlib

from podium.process import running, start_time
from podium.v1 import common_pb2
from podium.worker.agent.adoption import adopted_worker, record_of
from podium.worker.agent.managed import ManagedWorker


def recorded(pid: int) -> dict:
    """The entry a fork server hands over for a RUNNING worker whose process is ``pid``."""
    info = common_pb2.WorkerInfo(id="w-1", node_id="n")
    info.spec.name = "actor"
    worker = ManagedWorker(info, pathlib.Path("/tmp/w-1.out"), pathlib.Path("/tmp/w-1.err"))
    worker.ready.set_result(b'{"port": 4242}\n')
    return {"pid": pid, "start": start_time(pid), "meta": record_of(worker)}


def test_a_recorded_worker_comes_back_running_with_its_info_port_line_and_logs():
    async def check() -> None:
        worker = adopted_worker(recorded(os.getpid()))
        assert worker is not None
        assert (worker.id, worker.info.spec.name, worker.pid) == ("w-1", "actor", os.getpid())
        assert worker.state == common_pb2.WORKER_RUNNING and worker.alive
        assert worker.ready.result() == b'{"port": 4242}\n'
        assert worker.err_path == pathlib.Path("/tmp/w-1.err")

    asyncio.run(check())


def test_a_pid_whose_start_time_differs_is_a_reused_pid_and_is_not_adopted():
    async def check() -> None:
        entry = recorded(os.getpid())
        entry["start"] = entry["start"] - 1  # the recorded process started earlier: another one
        assert adopted_worker(entry) is None

    asyncio.run(check())


def test_no_record_or_a_bad_one_is_not_adopted_and_an_ended_one_comes_back_ended():
    async def check() -> None:
        assert adopted_worker({"pid": os.getpid(), "start": start_time(os.getpid()), "meta": None}) is None
        bad = recorded(os.getpid())
        bad["meta"]["info"] = "not base64 of a WorkerInfo!"
        assert adopted_worker(bad) is None
        ended = recorded(os.getpid())
        ended["code"] = -9
        worker = adopted_worker(ended)
        assert worker is not None and worker.exited.result() == -9 and not worker.alive

    asyncio.run(check())


def test_start_time_and_running_of_this_process_and_of_no_process():
    assert start_time(os.getpid()) is not None and running(os.getpid())
    assert start_time(2 ** 22 + 1) is None and not running(2 ** 22 + 1)  # above pid_max's limit
