"""The scheduler's HTTP endpoints (aiohttp, on the scheduler's event loop).

=================  =====  ====================================================
path               token  answer
=================  =====  ====================================================
GET /              no     the live dashboard page (podium.scheduler.dashboard)
GET /healthz       no     200 ``ok`` while the process serves
GET /readyz        no     200 ``ready`` once the state is loaded and gRPC serves
GET /v1/nodes      yes    ``{"nodes": [...]}``
GET /v1/placement  yes    every GPU: bundles, workers, fractions, real memory
GET /v1/workers    yes    ``{"workers": [...]}``
GET /metrics       yes    Prometheus text
=================  =====  ====================================================

The token is ``Authorization: Bearer <token>`` (401 otherwise, constant-time
check). Errors are JSON ``{"error": "..."}``: 404 unknown path, 405 wrong method.
"""

from __future__ import annotations

import json
import logging
from fractions import Fraction

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from podium.auth import token_matches
from podium.memcap import requested_cap
from podium.resources import CPU_UNITS, GPU_UNITS, BundleSpec, cpu_units, gpu_units
from podium.scheduler import dashboard
from podium.scheduler.httplimits import BoundedRunner
from podium.scheduler.state import LIVE_WORKER_STATES, ClusterModel, fraction_text
from podium.v1 import common_pb2

log = logging.getLogger(__name__)

__all__ = ["HttpServer", "placement_view", "nodes_view", "workers_view"]

_OPEN_PATHS = frozenset({"/healthz", "/readyz"}) | dashboard.PATHS


def _dict(message) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)


def nodes_view(model: ClusterModel) -> dict:
    """``{"nodes": [NodeStatus as JSON, ...]}`` in address order."""
    nodes = sorted(model.nodes.values(), key=lambda n: n.info.node_id)
    return {"nodes": [_dict(n) for n in nodes]}


#: Parts of an environment variable name that mark its value as a secret.
_SECRET_PARTS = frozenset({"TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "APIKEY", "CREDENTIAL",
                           "CREDENTIALS", "AUTH", "PRIVATE"})
REDACTED = "<redacted>"


def is_secret_name(name: str) -> bool:
    """True for env names like WANDB_API_KEY, HF_TOKEN, DB_PASSWORD (by ``_``-separated part)."""
    return any(part in _SECRET_PARTS for part in name.upper().replace("-", "_").split("_"))


def workers_view(model: ClusterModel) -> dict:
    """``{"workers": [WorkerInfo as JSON, ...]}``; the values of env variables whose names
    say secret (``*_TOKEN``, ``*_API_KEY``, ...) read ``<redacted>``."""
    out = []
    for worker in model.workers.values():
        doc = _dict(worker)
        for holder in (doc, doc.get("spec") or {}):  # WorkerInfo.env and WorkerSpec.env
            if "env" in holder:
                holder["env"] = {k: REDACTED if is_secret_name(k) else v for k, v in holder["env"].items()}
        out.append(doc)
    return {"workers": out}


def _bundle_units(group: common_pb2.PlacementGroup, index: int) -> BundleSpec:
    return BundleSpec.from_resources(dict(group.bundles[index].resources))


def placement_view(model: ClusterModel, scheduler_id: str = "") -> dict:
    """The GPU map of the cluster: the /v1/placement document.

    ::

        {"scheduler_id": str,
         "nodes": [{"node_id", "address", "hostname", "agent_port", "state": "NODE_ALIVE",
                    "last_heartbeat": unix s, "cpus_total": float, "cpus_reserved": float,
                    "gpus": [{"index", "uuid", "name", "memory_total_bytes", "memory_used_bytes",
                              "reserved_fraction": 0.5, "reserved_fraction_text": "1/2",
                              "bundles": [{"placement_group_id", "placement_group", "bundle_index",
                                           "gpu_fraction": 1.0, "gpu_fraction_text": "1"}],
                              "workers": [{"worker_id", "name", "group", "rank", "state", "pid",
                                           "port", "placement_group_id", "bundle_index",
                                           "gpu_fraction": 0.333..., "gpu_fraction_text": "1/3",
                                           "memory_used_bytes": int,
                                           "memory_cap": None | {"fraction", "bytes", "text",
                                                                 "applied", "detail"}}]}]}],
         "placement_groups": [{"id", "name", "state", "strategy", "detached", "owner",
                               "created_at", "reason",
                               "bundles": [{"index", "resources": {"CPU", "GPU"}, "node_id",
                                            "node_address", "gpu_indices", "gpu_uuids"}]}]}

    Removed groups and ended workers are left out. A worker's memory is the
    heartbeat's ProcessMemory for its pid on that GPU (by worker id when no pid). Its
    ``memory_cap`` is the GPU memory cap its group asked for (``gpu_memory_cap=``), None when
    it has none: ``bytes`` is the limit the worker enforces once it reported one, else the
    asked share of this GPU's NVML total; ``applied`` and ``detail`` are the worker's own
    report ("not applied: no CUDA"; ``applied`` None until the worker is ready).
    """
    groups = [g for g in model.groups.values() if g.state != common_pb2.PG_REMOVED]
    # (node, gpu index) -> bundles owning part or all of it
    owners: dict[tuple[str, int], list[dict]] = {}
    for group in groups:
        if group.state != common_pb2.PG_CREATED:
            continue
        for placed in group.placements:
            spec = _bundle_units(group, placed.bundle_index)
            share = spec.gpu_units if spec.is_fractional else GPU_UNITS
            for index in placed.gpu_indices:
                owners.setdefault((placed.node_id, index), []).append({
                    "placement_group_id": group.id, "placement_group": group.name,
                    "bundle_index": placed.bundle_index,
                    "gpu_fraction": share / GPU_UNITS, "gpu_fraction_text": fraction_text(share)})
    on_gpu: dict[tuple[str, int], list[common_pb2.WorkerInfo]] = {}
    for worker in model.workers.values():
        if worker.state in LIVE_WORKER_STATES:
            for index in worker.gpu_indices:
                on_gpu.setdefault((worker.node_id, index), []).append(worker)
    nodes = []
    for node in sorted(model.nodes.values(), key=lambda n: n.info.node_id):
        info = node.info
        memory: dict[tuple[int, str], int] = {}
        by_worker: dict[tuple[str, str], int] = {}
        for proc in node.processes:
            memory[(proc.pid, proc.gpu_uuid)] = memory.get((proc.pid, proc.gpu_uuid), 0) + proc.used_bytes
            if proc.worker_id:
                by_worker[(proc.worker_id, proc.gpu_uuid)] = proc.used_bytes
        gpus = []
        for gpu in sorted(info.gpus, key=lambda g: g.index):
            key = (info.node_id, gpu.index)
            bundles = owners.get(key, [])
            reserved = sum(Fraction(b["gpu_fraction_text"]) for b in bundles)
            workers = []
            for worker in sorted(on_gpu.get(key, []), key=lambda w: (w.spec.group, w.spec.rank)):
                units = gpu_units(worker.spec.num_gpus) if worker.spec.num_gpus else 0
                used = memory.get((worker.pid, gpu.uuid)) if worker.pid else None
                if used is None:
                    used = by_worker.get((worker.id, gpu.uuid), 0)
                workers.append({
                    "worker_id": worker.id, "name": worker.spec.name, "group": worker.spec.group,
                    "rank": worker.spec.rank, "state": common_pb2.WorkerState.Name(worker.state),
                    "pid": worker.pid, "port": worker.port,
                    "placement_group_id": worker.spec.placement_group_id,
                    "bundle_index": worker.spec.bundle_index,
                    "gpu_fraction": units / GPU_UNITS, "gpu_fraction_text": fraction_text(units),
                    "memory_used_bytes": used,
                    "memory_cap": _memory_cap(worker, gpu.memory_total_bytes)})
            gpus.append({
                "index": gpu.index, "uuid": gpu.uuid, "name": gpu.name,
                "memory_total_bytes": gpu.memory_total_bytes,
                "memory_used_bytes": gpu.memory_used_bytes,
                "reserved_fraction": float(reserved), "reserved_fraction_text": str(reserved),
                "bundles": bundles, "workers": workers})
        total_cpu = cpu_units(info.cpus) if info.cpus >= 0 else 0
        used_cpu = 0
        for group in groups:
            if group.state == common_pb2.PG_CREATED:
                for placed in group.placements:
                    if placed.node_id == info.node_id:
                        used_cpu += _bundle_units(group, placed.bundle_index).cpu_units
        nodes.append({
            "node_id": info.node_id, "address": info.address, "hostname": info.hostname,
            "agent_port": info.agent_port, "state": common_pb2.NodeState.Name(node.state),
            "last_heartbeat": node.last_heartbeat,
            "cpus_total": total_cpu / CPU_UNITS, "cpus_reserved": used_cpu / CPU_UNITS,
            "gpus": gpus})
    return {
        "scheduler_id": scheduler_id,
        "nodes": nodes,
        "placement_groups": [{
            "id": g.id, "name": g.name, "state": common_pb2.PlacementGroupState.Name(g.state),
            "strategy": common_pb2.Strategy.Name(g.strategy), "detached": g.detached,
            "owner": g.owner, "created_at": g.created_at, "reason": g.reason,
            "bundles": [_bundle_json(g, i) for i in range(len(g.bundles))],
        } for g in groups],
    }


def _memory_cap(worker: common_pb2.WorkerInfo, total_bytes: int) -> dict | None:
    """A worker's /v1/placement ``memory_cap``: asked (its env) and applied (its report)."""
    cap = requested_cap(worker.env or worker.spec.env, total_bytes)
    if cap is None:
        return None
    cap["applied"], cap["detail"] = None, "not reported yet"
    if worker.HasField("gpu_memory_cap"):
        report = worker.gpu_memory_cap
        cap["applied"], cap["detail"] = report.applied, report.detail
        if report.applied and report.cap_bytes:
            cap["bytes"] = report.cap_bytes
    return cap


def _bundle_json(group: common_pb2.PlacementGroup, index: int) -> dict:
    placed = next((p for p in group.placements if p.bundle_index == index), None)
    return {"index": index, "resources": dict(group.bundles[index].resources),
            "node_id": placed.node_id if placed else "",
            "node_address": placed.node_address if placed else "",
            "gpu_indices": list(placed.gpu_indices) if placed else [],
            "gpu_uuids": list(placed.gpu_uuids) if placed else []}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class HttpServer:
    """The aiohttp app bound to one SchedulerService."""

    def __init__(self, service, config) -> None:
        self.service = service
        self.config = config
        #: Set by the server once gRPC serves and the state is loaded (/readyz).
        self.ready = False
        self._runner: web.AppRunner | None = None
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/v1/nodes", self._nodes)
        app.router.add_get("/v1/placement", self._placement)
        app.router.add_get("/v1/workers", self._workers)
        app.router.add_get("/metrics", self._metrics)
        dashboard.install(app)  # GET /: the live dashboard page (its data needs the token)
        self.app = app

    async def start(self, host: str, port: int) -> int:
        """Bind and serve; returns the bound port (port 0 picks one)."""
        # Idle connections time out and their number is capped (podium.scheduler.httplimits).
        self._runner = BoundedRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        ssl_context = self.config.tls.ssl_context(server=True) if self.config.tls else None
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        await site.start()
        return self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        if request.path not in _OPEN_PATHS:
            header = request.headers.get("Authorization", "")
            presented = header[len("Bearer "):] if header.startswith("Bearer ") else None
            if not token_matches(self.config.token, presented):
                return _error(401, "missing or wrong cluster token (Authorization: Bearer <token>)")
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            reason = {404: f"no such path {request.path!r}",
                      405: f"method {request.method} not allowed on {request.path}"}.get(
                exc.status, exc.reason)
            return _error(exc.status, reason)
        except Exception as exc:  # noqa: BLE001 - a bug must not kill the endpoint
            log.exception("HTTP %s failed", request.path)
            return _error(500, f"{type(exc).__name__}: {exc}")

    async def _healthz(self, request):
        return web.Response(text="ok")

    async def _readyz(self, request):
        if not self.ready:
            return _error(503, "not ready")
        return web.Response(text="ready")

    async def _nodes(self, request):
        return web.json_response(nodes_view(self.service.model))

    async def _placement(self, request):
        return web.json_response(placement_view(self.service.model, self.service.scheduler_id),
                                 dumps=lambda v: json.dumps(v, indent=1))

    async def _workers(self, request):
        return web.json_response(workers_view(self.service.model))

    async def _metrics(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        metrics = self.service.metrics
        metrics.refresh(self.service.model)
        return web.Response(body=generate_latest(metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})
