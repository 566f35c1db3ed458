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
GET /v1/calls      yes    each group's last calls per method, rank by rank (callshttp)
GET /v1/stacks     yes    live workers' Python stacks (podium.scheduler.stackshttp)
GET /metrics       yes    Prometheus text
/api/...           yes    Ray's Jobs REST API (podium.scheduler.jobshttp)
=================  =====  ====================================================

The token is ``Authorization: Bearer <token>`` (what ``ray job --headers`` and
``RAY_JOB_HEADERS`` send), or the same in ``X-Ray-Authorization`` or the
``ray-authentication-token`` cookie (what Ray's own token authentication sends); 401
otherwise, constant-time check. Errors are JSON ``{"error": "..."}``: 404 unknown path,
405 wrong method (the Jobs API's are Ray's plain text).
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time

import orjson
from aiohttp import web
from google.protobuf.json_format import MessageToDict

from podium.auth import token_matches
from podium.memcap import requested_cap
from podium.resources import CPU_UNITS, GPU_UNITS, BundleSpec, cpu_units, gpu_units
from podium.scheduler import dashboard
from podium.scheduler.callshttp import CallsEndpoint
from podium.httplimits import HTTP_MAX_BODY_BYTES, BoundedRunner
from podium.scheduler.jobpackages import MAX_PACKAGE_BYTES
from podium.scheduler.jobshttp import JobsCollector, JobsEndpoints
from podium.scheduler.stackshttp import StacksEndpoint
from podium.scheduler.state import LIVE_WORKER_STATES, ClusterModel, fraction_text
from podium.scheduler.workers import RestartsCollector
from podium.v1 import common_pb2

log = logging.getLogger(__name__)

__all__ = ["HttpServer", "placement_view", "placement_json", "nodes_view", "workers_view",
           "RECORD_CHUNK", "PLACEMENT_CACHE_SECONDS"]

_OPEN_PATHS = frozenset({"/healthz", "/readyz"}) | dashboard.PATHS


def _dict(message) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)


def nodes_view(model: ClusterModel) -> dict:
    """``{"nodes": [NodeStatus as JSON, ...]}`` in address order."""
    return {"nodes": [_dict(n) for n in _sorted_nodes(model)]}


def _sorted_nodes(model: ClusterModel) -> list:
    return sorted(model.nodes.values(), key=lambda n: n.info.node_id)


#: Records rendered between two returns to the event loop (the chunked pages below).
RECORD_CHUNK = 100


async def _encoded_items(records: list, render, chunk: int = RECORD_CHUNK) -> bytes:
    """``render(r)`` of every record as comma-separated compact JSON (a list's inside),
    ``chunk`` records at a time with a return to the event loop in between, so heartbeats
    are served while a 1,000-node page is made (MessageToDict of 1,000 nodes alone takes
    ~0.2 s). One orjson call per chunk: ~6x faster than json."""
    parts = []
    for start in range(0, len(records), chunk):
        if start:
            await asyncio.sleep(0)
        parts.append(orjson.dumps([render(r) for r in records[start:start + chunk]])[1:-1])
    return b",".join(parts)


async def _chunked_json(key: str, records: list, render) -> bytes:
    """``{key: [render(r) for r in records]}`` as compact JSON (see _encoded_items)."""
    return b'{"' + key.encode() + b'":[' + await _encoded_items(records, render) + b"]}"


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
    return {"workers": [_worker_dict(w) for w in model.workers.values()]}


def _worker_dict(worker) -> dict:
    doc = _dict(worker)
    for holder in (doc, doc.get("spec") or {}):  # WorkerInfo.env and WorkerSpec.env
        if "env" in holder:
            holder["env"] = {k: REDACTED if is_secret_name(k) else v for k, v in holder["env"].items()}
    return doc


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
    ix = _PlacementIndex(model, {})
    return {
        "scheduler_id": scheduler_id,
        "nodes": [_node_doc(node, ix) for node in ix.nodes],
        "placement_groups": [_group_doc(g) for g in ix.groups],
    }


async def placement_json(model: ClusterModel, scheduler_id: str = "", chunk: int = RECORD_CHUNK,
                         kept: dict | None = None) -> bytes:
    """:func:`placement_view` as compact JSON bytes, its nodes built ``chunk`` at a time with
    a return to the event loop in between (:func:`_encoded_items`). Who owns which GPU is
    read at the start, in one step; a node's readings are as of when its chunk is rendered.

    ``kept`` (a dict the caller keeps between pages, see :class:`_PlacementIndex`) holds what
    each group contributes, so a group is rendered once while its record stays the same.
    """
    ix = _PlacementIndex(model, {} if kept is None else kept)
    nodes = await _encoded_items(ix.nodes, lambda node: _node_doc(node, ix), chunk)
    groups = b",".join(ix.group_json[g.id] for g in ix.groups)
    return (b'{"scheduler_id":' + orjson.dumps(scheduler_id) + b',"nodes":[' + nodes
            + b'],"placement_groups":[' + groups + b"]}")


class _PlacementIndex:
    """Who owns and runs on each GPU: one pass over the groups and one over the workers,
    so rendering is linear in the cluster (a per-node pass over every group took seconds
    on 1,000 nodes x 8 GPUs).

    What a group contributes (its bundles' owner documents and its own encoded document)
    depends only on its record, which rarely changes once placed: it is taken from ``kept``
    while the record serializes to the same bytes, and ``kept`` is left holding only the
    live groups' entries.
    """

    def __init__(self, model: ClusterModel, kept: dict) -> None:
        self.groups = [g for g in model.groups.values() if g.state != common_pb2.PG_REMOVED]
        #: (node, gpu index) -> bundles owning part or all of it, and their units together
        self.owners: dict[tuple[str, int], list[dict]] = {}
        self.reserved_units: dict[tuple[str, int], int] = {}
        self.cpu_reserved: dict[str, int] = {}
        #: group id -> its encoded placement_groups entry
        self.group_json: dict[str, bytes] = {}
        owners, reserved, cpu = self.owners, self.reserved_units, self.cpu_reserved
        fresh = {}
        for group in self.groups:
            record = group.SerializeToString()  # exact; 4 ms for 900 groups, rendering them ~45
            entry = kept.get(group.id)
            if entry is None or entry[0] != record:
                entry = (record, _group_bundles(model, group), orjson.dumps(_group_doc(group)))
            fresh[group.id] = entry
            self.group_json[group.id] = entry[2]
            for node_id, indices, doc, share, bundle_cpu in entry[1]:
                cpu[node_id] = cpu.get(node_id, 0) + bundle_cpu
                for index in indices:
                    key = (node_id, index)
                    owners.setdefault(key, []).append(doc)
                    reserved[key] = reserved.get(key, 0) + share
        kept.clear()
        kept.update(fresh)
        self.on_gpu: dict[tuple[str, int], list[common_pb2.WorkerInfo]] = {}
        for worker in model.workers.values():
            if worker.state in LIVE_WORKER_STATES:
                for index in worker.gpu_indices:
                    self.on_gpu.setdefault((worker.node_id, index), []).append(worker)
        self.nodes = sorted(model.nodes.values(), key=lambda n: n.info.node_id)


def _group_bundles(model: ClusterModel, group: common_pb2.PlacementGroup) -> list[tuple]:
    """A CREATED group's bundles as (node, GPU indices, owner document, GPU units per GPU,
    CPU units); none for a group not placed."""
    if group.state != common_pb2.PG_CREATED:
        return []
    specs = model.groups.bundles(group.id) if group.id in model.groups else None
    out = []
    for placed in group.placements:
        bundle_index = placed.bundle_index
        spec = specs[bundle_index] if specs else _bundle_units(group, bundle_index)
        share = spec.gpu_units if spec.is_fractional else GPU_UNITS
        # One document per bundle, listed under each GPU it owns.
        doc = {"placement_group_id": group.id, "placement_group": group.name,
               "bundle_index": bundle_index, "gpu_fraction": share / GPU_UNITS,
               "gpu_fraction_text": fraction_text(share)}
        out.append((placed.node_id, tuple(placed.gpu_indices), doc, share, spec.cpu_units))
    return out


_BY_INDEX = operator.attrgetter("index")
_NODE_STATES = {number: name for name, number in common_pb2.NodeState.items()}
_WORKER_STATES = {number: name for name, number in common_pb2.WorkerState.items()}


def _node_doc(node: common_pb2.NodeStatus, ix: _PlacementIndex) -> dict:
    info = node.info
    node_id = info.node_id
    memory: dict[tuple[int, str], int] = {}
    by_worker: dict[tuple[str, str], int] = {}
    for proc in node.processes:
        held = (proc.pid, proc.gpu_uuid)
        memory[held] = memory.get(held, 0) + proc.used_bytes
        if proc.worker_id:
            by_worker[(proc.worker_id, proc.gpu_uuid)] = proc.used_bytes
    owners, reserved_units, on_gpu = ix.owners, ix.reserved_units, ix.on_gpu
    gpus = []
    for gpu in sorted(info.gpus, key=_BY_INDEX):
        index = gpu.index
        key = (node_id, index)
        reserved = reserved_units.get(key, 0)
        workers = []
        here = on_gpu.get(key)
        if here:
            if len(here) > 1:
                here = sorted(here, key=lambda w: (w.spec.group, w.spec.rank))
            workers = [_worker_doc(worker, gpu, memory, by_worker) for worker in here]
        gpus.append({
            "index": index, "uuid": gpu.uuid, "name": gpu.name,
            "memory_total_bytes": gpu.memory_total_bytes,
            "memory_used_bytes": gpu.memory_used_bytes,
            "reserved_fraction": reserved / GPU_UNITS,
            "reserved_fraction_text": fraction_text(reserved),
            "bundles": owners.get(key, []), "workers": workers})
    total_cpu = cpu_units(info.cpus) if info.cpus >= 0 else 0
    return {
        "node_id": node_id, "address": info.address, "hostname": info.hostname,
        "agent_port": info.agent_port, "state": _NODE_STATES[node.state],
        "last_heartbeat": node.last_heartbeat,
        "cpus_total": total_cpu / CPU_UNITS,
        "cpus_reserved": ix.cpu_reserved.get(node_id, 0) / CPU_UNITS,
        "gpus": gpus}


def _worker_doc(worker: common_pb2.WorkerInfo, gpu: common_pb2.GpuInfo, memory: dict, by_worker: dict) -> dict:
    spec = worker.spec
    units = gpu_units(spec.num_gpus) if spec.num_gpus else 0
    used = memory.get((worker.pid, gpu.uuid)) if worker.pid else None
    if used is None:
        used = by_worker.get((worker.id, gpu.uuid), 0)
    return {"worker_id": worker.id, "name": spec.name, "group": spec.group, "rank": spec.rank,
            "state": _WORKER_STATES[worker.state], "pid": worker.pid, "port": worker.port,
            "placement_group_id": spec.placement_group_id, "bundle_index": spec.bundle_index,
            "gpu_fraction": units / GPU_UNITS, "gpu_fraction_text": fraction_text(units),
            "memory_used_bytes": used, "memory_cap": _memory_cap(worker, gpu.memory_total_bytes)}


def _group_doc(g: common_pb2.PlacementGroup) -> dict:
    return {"id": g.id, "name": g.name, "state": common_pb2.PlacementGroupState.Name(g.state),
            "strategy": common_pb2.Strategy.Name(g.strategy), "detached": g.detached,
            "owner": g.owner, "created_at": g.created_at, "reason": g.reason,
            "bundles": _bundles_json(g)}


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


def _bundles_json(group: common_pb2.PlacementGroup) -> list[dict]:
    placed_at = {p.bundle_index: p for p in group.placements}
    out = []
    for index, bundle in enumerate(group.bundles):
        placed = placed_at.get(index)
        out.append({"index": index, "resources": dict(bundle.resources),
                    "node_id": placed.node_id if placed else "",
                    "node_address": placed.node_address if placed else "",
                    "gpu_indices": list(placed.gpu_indices) if placed else [],
                    "gpu_uuids": list(placed.gpu_uuids) if placed else []})
    return out


#: How long one /v1/placement page is served again while no record changed (its memory
#: readings may be this much older than the last heartbeat).
PLACEMENT_CACHE_SECONDS = 1.0


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _presented_token(request: web.Request) -> str | None:
    """The token a request carries: ``Authorization: Bearer``, else Ray's own token auth's
    ``X-Ray-Authorization: Bearer`` header or ``ray-authentication-token`` cookie."""
    for name in ("Authorization", "X-Ray-Authorization"):
        header = request.headers.get(name, "")
        if header:
            return header[len("Bearer "):] if header.startswith("Bearer ") else None
    return request.cookies.get("ray-authentication-token")


class HttpServer:
    """The aiohttp app bound to one SchedulerService."""

    def __init__(self, service, config, jobs=None) -> None:
        self.service = service
        self.config = config
        #: Set by the server once gRPC serves and the state is loaded (/readyz).
        self.ready = False
        self._runner: web.AppRunner | None = None
        #: (model version, when, body) of the last /v1/placement page.
        self._placement_cache: tuple[int, float, bytes] | None = None
        #: What each live group contributes to the page (placement_json's ``kept``).
        self._placement_groups: dict = {}
        # Bodies are bounded per path before they are read (BoundedRunner's body_limit);
        # this is only aiohttp's own ceiling for the largest of them, a package upload.
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_PACKAGE_BYTES)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/v1/nodes", self._nodes)
        app.router.add_get("/v1/placement", self._placement)
        app.router.add_get("/v1/workers", self._workers)
        app.router.add_get("/v1/stacks", StacksEndpoint(service, config.token, config.tls).handle)
        app.router.add_get("/metrics", self._metrics)
        service.metrics.registry.register(RestartsCollector(service.model))
        # Each group's last calls per method, rank by rank, from the workers' timelines.
        app.router.add_get("/v1/calls", CallsEndpoint(service, config.token, config.tls).handle)
        dashboard.install(app)  # GET /: the live dashboard page (its data needs the token)
        self.jobs = JobsEndpoints(jobs, service.scheduler_id) if jobs is not None else None
        if self.jobs is not None:
            self.jobs.install(app)  # Ray's Jobs REST API
            service.metrics.registry.register(JobsCollector(jobs))
        self.app = app

    async def start(self, host: str, port: int) -> int:
        """Bind and serve; returns the bound port (port 0 picks one)."""
        # Connections and bodies are bounded, probes never starved (podium.httplimits).
        self._runner = BoundedRunner(self.app, access_log=None, handle_signals=False,
                                     body_limit=self._body_limit)
        ssl_context = self.config.tls.ssl_context(server=True) if self.config.tls else None
        return await self._runner.serve(host, port, ssl_context)

    async def stop(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _body_limit(self, request: web.Request) -> int:
        """The jobs API's submit and upload take larger bodies; no other path takes one."""
        limit = self.jobs.body_limit(request) if self.jobs is not None else None
        return HTTP_MAX_BODY_BYTES if limit is None else limit

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        if request.path not in _OPEN_PATHS:
            if not token_matches(self.config.token, _presented_token(request)):
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
        body = await _chunked_json("nodes", _sorted_nodes(self.service.model), _dict)
        return web.Response(body=body, content_type="application/json")

    async def _placement(self, request):
        # Compact JSON (json's C encoder runs only without indent: on 1,000 nodes the
        # indented, pure-Python encoding took ~0.4 s of the scheduler's loop, and 40% more
        # bytes), made in chunks, and one page serves every poll within PLACEMENT_CACHE_SECONDS
        # while no record changed (each open dashboard polls every 1.5 s).
        model = self.service.model
        now = time.monotonic()
        cached = self._placement_cache
        if cached is None or cached[0] != model.version or now - cached[1] > PLACEMENT_CACHE_SECONDS:
            body = await placement_json(model, self.service.scheduler_id, kept=self._placement_groups)
            cached = self._placement_cache = (model.version, now, body)
        return web.Response(body=cached[2], content_type="application/json")

    async def _workers(self, request):
        body = await _chunked_json("workers", list(self.service.model.workers.values()), _worker_dict)
        return web.Response(body=body, content_type="application/json")

    async def _metrics(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        metrics = self.service.metrics
        metrics.refresh(self.service.model)
        return web.Response(body=generate_latest(metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})
