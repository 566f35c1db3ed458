"""The node agent's Prometheus endpoint (``podium node --metrics-port N``).

One scrape target per machine: ``GET /metrics`` (token required, ``Authorization:
Bearer``) answers the agent's own gauges and, for every running worker of this node, the
counters its host keeps (read with one ``Worker.Describe`` per worker, 2 s deadline, in
parallel). ``GET /healthz`` is open. The server binds the agent's ``--host``.

==========================================  =========  =========================================
metric                                      type       labels
==========================================  =========  =========================================
podium_node_workers                         gauge      state (STARTING, RUNNING, EXITED, FAILED)
podium_node_gpus                            gauge
podium_node_gpu_memory_used_bytes           gauge      gpu, uuid
podium_node_gpu_memory_total_bytes          gauge      gpu, uuid
podium_worker_up                            gauge      worker_id, name, group, rank (0: no answer)
podium_worker_calls_total                   counter    worker_id, name, group, rank
podium_worker_call_errors_total             counter    same
podium_worker_calls_in_flight               gauge      same
podium_worker_call_seconds_total            counter    same (time in calls and constructors)
podium_worker_received_bytes_total          counter    same (call payloads)
podium_worker_sent_bytes_total              counter    same (reply payloads)
podium_worker_fetches_served_total          counter    same (held results fetched by others)
podium_worker_served_bytes_total            counter    same
podium_worker_fetches_made_total            counter    same (refs this worker fetched)
podium_worker_fetched_bytes_total           counter    same
podium_method_call_seconds                  histogram  node, group, method (+ le): per call
podium_method_received_bytes_total          counter    node, group, method (call payloads)
podium_method_sent_bytes_total              counter    node, group, method (reply payloads)
==========================================  =========  =========================================

Then the application metrics of the node's workers (``ray.util.metrics`` ``Counter``,
``Gauge``, ``Histogram``), under the names and tags the application gave them plus
``worker_id`` (:mod:`podium.worker.usermetrics` says how they get here).

The ``podium_method_*`` families add up the node's workers of one group (ranks summed:
groups x methods series, not ranks) from each worker's ``method_stats``
(:mod:`podium.worker.agent.methodmetrics`). A worker counts at most 64 method names (a
group too); calls to the rest are counted under ``method="other"``, the constructor under
``method="__init__"``. The histogram's buckets run from 1 ms to 600 s, then +Inf.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from podium import rpc
from podium.auth import token_matches
from podium.httplimits import BoundedRunner
from podium.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from podium.worker import usermetrics
from podium.worker.agent import methodmetrics

__all__ = ["FAMILIES", "MetricsServer", "render"]

log = logging.getLogger(__name__)

#: Deadline of the Describe call a scrape makes to each worker.
DESCRIBE_TIMEOUT = 2.0

# stats key -> (metric name, type, help)
_WORKER_STATS = {
    "calls": ("podium_worker_calls_total", "counter", "CALLs the worker ran"),
    "call_errors": ("podium_worker_call_errors_total", "counter", "calls and constructors that failed"),
    "calls_in_flight": ("podium_worker_calls_in_flight", "gauge", "calls and constructors running now"),
    "call_seconds": ("podium_worker_call_seconds_total", "counter", "seconds spent in calls and constructors"),
    "bytes_in": ("podium_worker_received_bytes_total", "counter", "call payload bytes received"),
    "bytes_out": ("podium_worker_sent_bytes_total", "counter", "reply payload bytes sent"),
    "fetches_served": ("podium_worker_fetches_served_total", "counter", "held results fetched by others"),
    "bytes_served": ("podium_worker_served_bytes_total", "counter", "bytes of held results served"),
    "fetches_made": ("podium_worker_fetches_made_total", "counter", "refs this worker fetched"),
    "bytes_fetched": ("podium_worker_fetched_bytes_total", "counter", "bytes this worker fetched"),
}


#: Every family :func:`render` writes: name -> type (the Grafana dashboard's test reads it).
FAMILIES = {
    "podium_node_workers": "gauge", "podium_node_gpus": "gauge",
    "podium_node_gpu_memory_used_bytes": "gauge", "podium_node_gpu_memory_total_bytes": "gauge",
    "podium_worker_up": "gauge",
    **{name: kind for name, kind, _ in _WORKER_STATS.values()},
    **{name: kind for name, (kind, _) in methodmetrics.FAMILIES.items()},
}


def _labels(pairs: dict[str, Any]) -> str:
    def esc(value: Any) -> str:
        return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in pairs.items()) + "}" if pairs else ""


def _num(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) and not float(value).is_integer() else str(int(value))


async def _describe(info: common_pb2.WorkerInfo, token: str, tls) -> worker_pb2.DescribeResponse | None:
    channel = rpc.make_channel(f"{info.node_address}:{info.port}", token, tls)
    try:
        return await worker_pb2_grpc.WorkerStub(channel).Describe(
            worker_pb2.DescribeRequest(), timeout=DESCRIBE_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - a worker that does not answer is reported as down
        log.debug("metrics: worker %s did not answer Describe: %s", info.id, exc)
        return None
    finally:
        await channel.close()


async def render(agent: Any) -> str:
    """The Prometheus text exposition of this agent and its running workers."""
    workers = [w.to_proto() for w in agent.spawner.workers()]
    lines: list[str] = []

    def family(name: str, kind: str, text: str) -> None:
        lines.append(f"# HELP {name} {text}")
        lines.append(f"# TYPE {name} {kind}")

    family("podium_node_workers", "gauge", "workers this agent started, by state")
    counts: dict[str, int] = {}
    for w in workers:
        state = common_pb2.WorkerState.Name(w.state).removeprefix("WORKER_")
        counts[state] = counts.get(state, 0) + 1
    for state in ("STARTING", "RUNNING", "EXITED", "FAILED"):
        counts.setdefault(state, 0)
    for state, count in sorted(counts.items()):
        lines.append(f"podium_node_workers{_labels({'state': state})} {count}")
    gpus = agent.node_info().gpus
    family("podium_node_gpus", "gauge", "GPUs of this node")
    lines.append(f"podium_node_gpus {len(gpus)}")
    family("podium_node_gpu_memory_used_bytes", "gauge", "GPU memory in use (NVML)")
    for g in gpus:
        lines.append(f"podium_node_gpu_memory_used_bytes{_labels({'gpu': g.index, 'uuid': g.uuid})} "
                     f"{g.memory_used_bytes}")
    family("podium_node_gpu_memory_total_bytes", "gauge", "GPU memory")
    for g in gpus:
        lines.append(f"podium_node_gpu_memory_total_bytes{_labels({'gpu': g.index, 'uuid': g.uuid})} "
                     f"{g.memory_total_bytes}")

    running = [w for w in workers if w.state == common_pb2.WORKER_RUNNING and w.port]
    answers = await asyncio.gather(*(_describe(w, agent.token, agent.config.tls) for w in running))
    family("podium_worker_up", "gauge", "1 if the worker answered Describe for this scrape")
    rows = []
    methods = methodmetrics.MethodTotals()
    for w, reply in zip(running, answers):
        labels = _labels({"worker_id": w.id, "name": w.spec.name, "group": w.spec.group, "rank": w.spec.rank})
        lines.append(f"podium_worker_up{labels} {0 if reply is None else 1}")
        if reply is not None:
            rows.append((labels, dict(reply.stats)))
            methods.add(w.spec.group, reply.method_stats)
    for key, (name, kind, text) in _WORKER_STATS.items():
        family(name, kind, text)
        for labels, stats in rows:
            if key in stats:
                lines.append(f"{name}{labels} {_num(stats[key])}")
    methodmetrics.render_methods(methods, agent.node_id, family, _labels, lines)
    # The workers' application metrics (ray.util.metrics): their snapshot files, read here.
    folder = getattr(agent, "metrics_dir", None)
    lines.extend(await asyncio.to_thread(usermetrics.render_dir, folder, {w.id for w in workers}))
    return "\n".join(lines) + "\n"


class MetricsServer:
    """aiohttp server with ``/metrics`` (token) and ``/healthz`` for one agent."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        """Bind and serve; returns the bound port."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        # The scheduler's connection and body bounds (podium.httplimits): a client
        # without the token can neither starve /healthz nor use up the agent's descriptors.
        self._runner = BoundedRunner(app, access_log=None, handle_signals=False)
        tls = self.agent.config.tls
        self.port = await self._runner.serve(host, port,
                                             tls.ssl_context(server=True) if tls else None)
        return self.port

    async def stop(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        header = request.headers.get("Authorization", "")
        presented = header[len("Bearer "):] if header.startswith("Bearer ") else None
        if not token_matches(self.agent.token, presented):
            return web.json_response({"error": "missing or wrong cluster token (Authorization: Bearer <token>)"},
                                     status=401)
        text = await render(self.agent)
        return web.Response(body=text.encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
