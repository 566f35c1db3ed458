"""``podium.timeline``: one Chrome trace of what the controller and every worker did lately.

Each process records its spans in its ring (:mod:`podium.tracering`): the controller its
side of each group call (``dispatch``, ``execute``: sending and, for a blocking call,
waiting; ``collect``), and ``put`` and ``get``; a worker every call it served (``call``: from
the arguments received to the reply sent), the method itself (``run``) and the refs it
fetched from other workers (``fetch``: a ``DataProtoFuture`` read). Every rank's call of one
group call carries the same trace id (``CallHeader.trace_id``), tasks and actor methods
included (they are group calls of one rank).

:func:`timeline` asks every worker of the session for its ring (the Worker ``Timeline`` RPC,
all at once, each within :data:`COLLECT_TIMEOUT`), and puts all spans on the controller's
clock: a worker's offset is its clock at the answer minus the midpoint of the round trip, so
spans of different machines line up within half a round trip. The result is the Chrome trace
event format (what Perfetto and ``chrome://tracing`` open): complete events (``"ph": "X"``)
with ``ts``/``dur`` in microseconds, one process per group (``"group NAME"``) with one lane
per rank (``"rank R @ NODE"``), and one for the controller. A call's span is split into
what it waited for: ``queued`` (arguments received to the method's start), the method, and
``reply`` (its end to the reply sent). A worker that does not answer is named in a
``podium_unanswered`` metadata event (and logged); the rest of the trace is still returned.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from typing import Any

from podium import errors
from podium.private import open_private
from podium.tracering import RING, Span

__all__ = ["timeline", "chrome_events", "COLLECT_TIMEOUT"]

log = logging.getLogger("podium.controller.observe.timeline")

#: How long one worker may take to send its ring.
COLLECT_TIMEOUT = 10.0
_CONTROLLER_PID = 0


def timeline(filename: str | None = None) -> list[dict] | None:
    """Ray's ``ray.timeline``: the trace events of this session (see the module docstring);
    with ``filename`` they are written there as a JSON array (what Perfetto's JSON importer
    and ``chrome://tracing`` open) and None is returned."""
    from podium.controller.session.runtime import get_runtime

    rt = get_runtime()
    workers = {h.worker_id: h for group in rt.groups() for h in group._members.workers}
    answers = rt.run(_collect(list(workers.values())), timeout=COLLECT_TIMEOUT + 10, what="timeline")
    events = chrome_events(RING.spans(), answers)
    if filename is None:
        return events
    try:
        with open_private(filename, "w") as out:  # 0600 like every file Podium writes
            json.dump(events, out)
    except OSError as exc:
        raise errors.InvalidArgumentError(f"cannot write the timeline to {filename!r}: {exc}") from None
    return None


async def _collect(handles: list) -> list[tuple[Any, Any]]:
    """(handle, (TimelineResponse, sent_ns, received_ns) or the exception) per worker."""
    async def one(handle: Any) -> Any:
        try:
            return await handle.client.channel.timeline(timeout=COLLECT_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - named in the trace, not raised
            return exc
    answers = await asyncio.gather(*(one(h) for h in handles))
    return list(zip(handles, answers))


def chrome_events(controller_spans: list[Span], answers: list[tuple[Any, Any]]) -> list[dict]:
    """The trace events of the controller's spans and each worker's answer (see the module
    docstring); ``answers``: (worker handle, (TimelineResponse, sent_ns, received_ns) or an
    exception)."""
    events: list[dict] = [_meta("process_name", _CONTROLLER_PID, None, f"controller (pid {os.getpid()})")]
    threads: dict[int, int] = {}
    for span in controller_spans:
        tid = threads.setdefault(span.thread, len(threads))
        events.append(_complete(span.kind, span.name, span.start_ns, span.end_ns, _CONTROLLER_PID, tid,
                                _args(span)))
    for ident, tid in threads.items():
        name = "main" if ident == threading.main_thread().ident else f"thread {tid}"
        events.append(_meta("thread_name", _CONTROLLER_PID, tid, name))
    groups: dict[str, int] = {}
    unanswered = []
    for handle, answer in answers:
        info = handle.info
        group = info.spec.group or info.spec.name
        pid = groups.get(group)
        if pid is None:
            pid = groups[group] = len(groups) + 1
            events.append(_meta("process_name", pid, None, f"group {group}"))
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "ts": 0,
                           "args": {"sort_index": pid}})
        tid = handle.rank
        events.append(_meta("thread_name", pid, tid, f"rank {tid} @ {info.node_id or info.node_address} "
                                                     f"(pid {info.pid})"))
        if isinstance(answer, BaseException):
            unanswered.append({"worker_id": handle.worker_id, "group": group, "rank": tid,
                               "error": f"{type(answer).__name__}: {answer}"})
            continue
        reply, sent, received = answer
        offset = reply.now_ns - (sent + received) // 2  # the worker's clock minus ours
        events.extend(_worker_events(reply.events, offset, pid, tid))
    if unanswered:
        log.warning("timeline: %d worker(s) did not answer: %s", len(unanswered), unanswered)
        events.append({"ph": "M", "name": "podium_unanswered", "pid": _CONTROLLER_PID, "tid": 0, "ts": 0,
                       "args": {"workers": unanswered}})
    return events


def _worker_events(spans: Any, offset: int, pid: int, tid: int) -> list[dict]:
    runs: dict[int, list] = {}
    for s in spans:
        if s.kind == "run" and s.trace_id:
            runs.setdefault(s.trace_id, []).append(s)
    out = []
    for s in spans:
        start, end = s.start_ns - offset, s.end_ns - offset
        args = {"trace_id": s.trace_id, "call_id": s.call_id, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
                "ok": s.ok}
        out.append(_complete(s.kind, s.name, start, end, pid, tid, args))
        if s.kind != "call":
            continue
        for run in runs.get(s.trace_id, ()):  # the phases around the method
            if s.start_ns <= run.start_ns and run.end_ns <= s.end_ns:
                out.append(_complete("queued", s.name, start, run.start_ns - offset, pid, tid,
                                     {"trace_id": s.trace_id}))
                out.append(_complete("reply", s.name, run.end_ns - offset, end, pid, tid,
                                     {"trace_id": s.trace_id, "bytes_out": s.bytes_out}))
                break
    return out


def _args(span: Span) -> dict:
    args: dict[str, Any] = {"trace_id": span.trace_id} if span.trace_id else {}
    if not span.ok:
        args["ok"] = False
    return args


def _complete(cat: str, name: str, start_ns: int, end_ns: int, pid: int, tid: int, args: dict) -> dict:
    return {"ph": "X", "cat": cat, "name": f"{name} ({cat})" if cat in ("queued", "reply") else name,
            "ts": start_ns / 1000, "dur": max(0, end_ns - start_ns) / 1000, "pid": pid, "tid": tid, "args": args}


def _meta(kind: str, pid: int, tid: int | None, name: str) -> dict:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid or 0, "ts": 0, "args": {"name": name}}
