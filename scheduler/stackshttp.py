"""``GET /v1/stacks?group=&rank=&worker=&timeout=``: the live workers' Python stacks as JSON.

The scheduler knows where every worker serves and where every node agent listens, and holds
the cluster token, so it asks them itself (:mod:`podium.workerstacks`: all in parallel, each
within ``timeout`` seconds, 2 by default) and answers ``{"workers": [...]}`` with one entry per
worker: group, rank, worker id, node, pid, /proc state, and its threads or why it has none.
One collection runs at a time (a second request meanwhile gets 429), so a client polling fast
cannot multiply the fan-out.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from podium import errors
from podium.limits import check_seconds
from podium.v1 import common_pb2, scheduler_pb2
from podium.workerstacks import DEFAULT_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS, collect_from, select_workers

__all__ = ["StacksEndpoint"]


def _query(request: web.Request) -> dict[str, Any]:
    """The filters of the query string, checked (InvalidArgumentError names a bad one)."""
    q = request.query
    out: dict[str, Any] = {"group": q.get("group") or None, "worker_id": q.get("worker") or None,
                           "rank": None, "timeout": DEFAULT_TIMEOUT_SECONDS}
    if q.get("rank"):
        try:
            out["rank"] = int(q["rank"])
        except ValueError:
            raise errors.InvalidArgumentError(f"rank must be an integer, got {q['rank']!r}") from None
    if q.get("timeout"):
        try:
            value = float(q["timeout"])
        except ValueError:
            raise errors.InvalidArgumentError(f"timeout must be seconds, got {q['timeout']!r}") from None
        out["timeout"] = check_seconds(value, "timeout", MAX_TIMEOUT_SECONDS) or DEFAULT_TIMEOUT_SECONDS
    return out


class StacksEndpoint:
    """The handler of ``GET /v1/stacks`` over one scheduler service (its model), token and TLS."""

    def __init__(self, service: Any, token: str, tls: Any = None) -> None:
        self._service = service
        self._token = token
        self._tls = tls
        self._running = asyncio.Lock()

    async def handle(self, request: web.Request) -> web.Response:
        """Collect and answer (400 for a bad filter, 429 while another collection runs)."""
        try:
            query = _query(request)
        except errors.InvalidArgumentError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        if self._running.locked():
            return web.json_response({"error": "a stacks collection is running; retry shortly"}, status=429)
        async with self._running:
            nodes, _, workers = self._service.model.cluster_state()
            view = scheduler_pb2.ClusterState(workers=[w for w in workers if w.state == common_pb2.WORKER_RUNNING])
            chosen = select_workers(view, group=query["group"], rank=query["rank"], worker_id=query["worker_id"])
            needed = {w.node_id for w in chosen}
            state = scheduler_pb2.ClusterState(nodes=[n for n in nodes if n.info.node_id in needed])
            report = await collect_from(state, chosen, self._token, self._tls, timeout=query["timeout"])
        return web.json_response(report.to_dict())
