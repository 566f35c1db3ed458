"""Workers a restarted agent takes over from its previous incarnation's fork server.

A node agent that is SIGKILLed and started again (same node, same log folder) finds the fork
server of its previous incarnation still holding the workers (:mod:`podium.worker.agent.forkhelper`)
and re-adopts them: the job's calls, which go straight to the workers, never notice. For that,
the agent records with the fork server, once a worker is RUNNING, what it needs to manage that
worker again (:func:`record_of`), and rebuilds a :class:`ManagedWorker` from each record it is
handed (:func:`adopted_worker`).

A record names a process by pid *and* start time (:func:`podium.process.start_time`): a pid
whose process started at another time is a reused pid, some other process, and is never
adopted. Workers that were still starting when the agent died have no record (their ready pipe
died with the agent); they are killed, not adopted.
"""

from __future__ import annotations

import base64
import logging
import pathlib

from google.protobuf.message import DecodeError

from podium.process import start_time
from podium.v1 import common_pb2
from podium.worker.agent.managed import ManagedWorker

log = logging.getLogger(__name__)

__all__ = ["record_of", "adopted_worker"]


def record_of(worker: ManagedWorker) -> dict:
    """What a restarted agent needs to manage ``worker`` again (JSON-able)."""
    return {"info": base64.b64encode(worker.info.SerializeToString()).decode(),
            "ready": worker.ready.result().decode(errors="replace") if worker.ready.done() else "",
            "out": str(worker.out_path), "err": str(worker.err_path)}


def adopted_worker(entry: dict) -> ManagedWorker | None:
    """The worker a fork server handed over as ``entry`` (``{"pid", "start", "meta"[, "code"]}``),
    RUNNING with its port, or None when it must not be adopted (no record, a bad record, or
    the pid now names another process). Its exit, if it ended meanwhile, is set."""
    pid, meta = int(entry["pid"]), entry.get("meta")
    if not isinstance(meta, dict):
        return None
    if "code" not in entry and start_time(pid) != entry.get("start"):
        log.warning("pid %d: its start time is not the recorded one (a reused pid): not adopting it", pid)
        return None
    try:
        info = common_pb2.WorkerInfo.FromString(base64.b64decode(meta["info"]))
        worker = ManagedWorker(info, pathlib.Path(meta["out"]), pathlib.Path(meta["err"]))
    except (KeyError, TypeError, ValueError, DecodeError) as exc:
        log.warning("pid %d: unusable adoption record (%s): not adopting it", pid, exc)
        return None
    worker.pid = pid
    worker.state = common_pb2.WORKER_RUNNING
    worker.ready.set_result(str(meta.get("ready", "")).encode())
    if "code" in entry:
        worker.exited.set_result(int(entry["code"]))
    return worker
