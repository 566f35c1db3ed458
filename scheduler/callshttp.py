"""``GET /v1/calls?group=&k=``: each group's last calls per method, rank by rank (the
dashboard's group view, where a straggler stands out).

The scheduler knows where every running worker serves and holds the cluster token, so it
asks each worker of the selected groups for its recent spans (the Worker ``Timeline`` RPC,
:mod:`podium.tracering`; all in parallel, each within :data:`TIMEOUT_SECONDS`) and groups
them: per group and method, the last ``k`` calls (one group call is one trace id across the
ranks), each with every rank's duration and bytes moved. A worker that does not answer is
listed under ``unanswered``. One collection runs at a time (a second request meanwhile gets
429), so a page polling fast cannot multiply the fan-out.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from podium.rpc import make_channel
from podium.v1 import common_pb2, worker_pb2, worker_pb2_grpc

__all__ = ["CallsEndpoint", "group_calls", "MAX_K", "TIMEOUT_SECONDS"]

#: Calls per method a request may ask for (``k``), at most; 10 by default.
MAX_K = 50
_DEFAULT_K = 10
#: How long one worker may take to send its spans.
TIMEOUT_SECONDS = 2.0
# Spans asked of each worker (its newest): enough for MAX_K calls of a few methods.
_SPANS_PER_WORKER = 4096
# Workers asked per request, at most (a page of 1,000 ranks still answers).
_MAX_WORKERS = 1024


def group_calls(spans_by_rank: dict[int, Any], k: int) -> dict[str, list[dict]]:
    """method -> its last ``k`` calls, newest first: ``{"trace_id", "start_ns", "ranks":
    {rank: {"ms", "bytes", "ok"}}}``; ``spans_by_rank``: rank -> its TraceEvents."""
    calls: dict[str, dict[int, dict]] = {}
    for rank, spans in spans_by_rank.items():
        for span in spans:
            if span.kind != "call" or not span.trace_id or not span.name:
                continue
            call = calls.setdefault(span.name, {}).setdefault(
                span.trace_id, {"trace_id": span.trace_id, "start_ns": span.start_ns, "ranks": {}})
            call["start_ns"] = min(call["start_ns"], span.start_ns)
            call["ranks"][str(rank)] = {"ms": round((span.end_ns - span.start_ns) / 1e6, 3),
                                        "bytes": span.bytes_in + span.bytes_out, "ok": span.ok}
    return {method: sorted(by_trace.values(), key=lambda c: -c["start_ns"])[:k]
            for method, by_trace in sorted(calls.items())}


async def _spans(worker: Any, token: str, tls: Any) -> Any:
    channel = make_channel(f"{worker.node_address}:{worker.port}", token, tls)
    try:
        reply = await worker_pb2_grpc.WorkerStub(channel).Timeline(
            worker_pb2.TimelineRequest(max_events=_SPANS_PER_WORKER), timeout=TIMEOUT_SECONDS)
        return list(reply.events)
    except Exception as exc:  # noqa: BLE001 - named in the answer
        return exc
    finally:
        await channel.close()


class CallsEndpoint:
    """The handler of ``GET /v1/calls`` over one scheduler service (its model), token and TLS."""

    def __init__(self, service: Any, token: str, tls: Any = None) -> None:
        self._service = service
        self._token = token
        self._tls = tls
        self._running = asyncio.Lock()

    async def handle(self, request: web.Request) -> web.Response:
        """Collect and answer (400 for a bad ``k``, 429 while another collection runs)."""
        group = request.query.get("group") or None
        try:
            k = int(request.query.get("k") or _DEFAULT_K)
        except ValueError:
            return web.json_response({"error": f"k must be an integer, got {request.query['k']!r}"}, status=400)
        if not 1 <= k <= MAX_K:
            return web.json_response({"error": f"k = {k} must be in [1, {MAX_K}]"}, status=400)
        if self._running.locked():
            return web.json_response({"error": "a calls collection is running; retry shortly"}, status=429)
        async with self._running:
            _, _, workers = self._service.model.cluster_state()
            chosen = sorted((w for w in workers if w.state == common_pb2.WORKER_RUNNING and w.port
                             and (group is None or w.spec.group == group)),
                            key=lambda w: (w.spec.group, w.spec.rank))[:_MAX_WORKERS]
            answers = await asyncio.gather(*(_spans(w, self._token, self._tls) for w in chosen))
        by_group: dict[str, dict[int, Any]] = {}
        unanswered = []
        for worker, answer in zip(chosen, answers):
            if isinstance(answer, BaseException):
                unanswered.append({"group": worker.spec.group, "rank": worker.spec.rank, "worker_id": worker.id,
                                   "error": f"{type(answer).__name__}: {answer}"})
                continue
            by_group.setdefault(worker.spec.group, {})[worker.spec.rank] = answer
        groups = {name: {"ranks": sorted(spans), "methods": group_calls(spans, k)}
                  for name, spans in sorted(by_group.items())}
        return web.json_response({"groups": groups, "unanswered": unanswered})
