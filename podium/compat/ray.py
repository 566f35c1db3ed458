"""``import podium.compat.ray as ray``: the part of Ray's API a verl trainer uses, on Podium.

Provided (see the README's table): ``init``, ``shutdown``, ``is_initialized``, ``get``,
``put``, ``wait``, ``remote``, ``get_actor``, ``kill``, ``cancel``, ``method``,
``get_runtime_context``, ``cluster_resources``, ``available_resources``, ``nodes``,
``get_gpu_ids``, ``ObjectRef``, ``ObjectRefGenerator``, ``util.placement_group`` / ``remove_placement_group`` /
``get_placement_group`` / ``list_named_actors``, ``util.scheduling_strategies``
(``PlacementGroupSchedulingStrategy``, ``NodeAffinitySchedulingStrategy``) and
``exceptions`` (Ray's names for Podium's errors). Any other public Ray name raises
:class:`podium.errors.NotProvidedError` (a ``NotImplementedError`` and an ``AttributeError``)
naming the Ray API and what to use on Podium instead.

Where it differs from Ray: ``cancel`` stops waiting for a call (its ref raises
``TaskCancelledError``) but does not interrupt a call already running in its worker;
node ids are the scheduler's node ids in the controller and the node's address in a worker.
"""

from __future__ import annotations

import os
import types
from typing import Any

from podium import errors as _errors
from podium import runtimeenv as _runtimeenv
from podium.compat import rayexceptions as _rayexceptions
from podium.compat import rayoptions as _rayoptions
from podium.compat import raycontext as _raycontext
from podium.compat.raycontext import RuntimeContext, get_runtime_context
from podium.controller.remote import actoroptions as _options
from podium.controller.remote import placement as _placement
from podium.controller.session import runtime as _runtime
from podium.controller.remote.actors import get_actor as _get_actor
from podium.controller.remote.actors import kill as _kill
from podium.controller.session.futures import PendingRef as _PendingRef
from podium.controller.session.gets import get as _get
from podium.controller.session.gets import wait as _wait
from podium.controller.remote.objects import put as _put
from podium.controller.remote.streams import ObjectRefGenerator
from podium.controller.remote.tasks import remote as _remote
from podium.refs import ObjectRef as _HeldRef

__all__ = ["init", "shutdown", "is_initialized", "get", "put", "wait", "remote", "get_actor", "kill",
           "cancel", "method", "get_runtime_context", "cluster_resources", "available_resources", "nodes",
           "get_gpu_ids", "timeline", "ObjectRef", "ObjectRefGenerator", "util", "exceptions", "RuntimeContext"]


class _ObjectRefType(type):
    """The metaclass of :class:`ObjectRef`: ``isinstance`` is true for both kinds of Podium ref."""

    def __instancecheck__(cls, value: Any) -> bool:
        return isinstance(value, (_HeldRef, _PendingRef))

    def __subclasscheck__(cls, subclass: type) -> bool:
        return isinstance(subclass, type) and issubclass(subclass, (_HeldRef, _PendingRef))


class ObjectRef(metaclass=_ObjectRefType):
    """``ray.ObjectRef``, for ``isinstance`` checks: what ``ray.put`` returns (a held
    :class:`podium.refs.ObjectRef`) and what ``.remote()`` returns (a
    :class:`podium.controller.session.futures.PendingRef`, before and after its call finished) are both
    instances, as in Ray both are ObjectRefs (verl's collect functions check a
    ``blocking=False`` call's per-rank results this way). It is not constructed directly."""

    def __new__(cls, *args: Any, **kwargs: Any) -> ObjectRef:
        raise NotImplementedError("ray.ObjectRef(...) cannot be constructed on Podium; on Podium use: "
                                  "ray.put(value) or a remote call's .remote(), which return refs")


def init(address: str | None = None, *, num_cpus: float | None = None, num_gpus: int | None = None,
         ignore_reinit_error: bool = False, resources: dict[str, float] | None = None, **kwargs: Any) -> Any:
    """``ray.init``: join the cluster at ``address`` ("auto" or None: ``PODIUM_ADDRESS``, else
    an embedded cluster on this machine). ``namespace`` sets the default for named actors;
    ``runtime_env``: ``env_vars`` are set for the embedded cluster's workers and (through the
    stand-in's ``remote``) for every worker; ``py_executable``, ``working_dir``, ``py_modules``, ``pip``
    and ``uv`` are inherited by every actor and task of the job (:mod:`podium.runtimeenv`); other keys are
    refused naming the alternative. Every other keyword of Ray's is answered by
    :data:`podium.compat.rayoptions.INIT`: refused with the alternative, or accepted where it
    cannot matter on Podium."""
    _rayoptions.check("ray.init", _rayoptions.INIT, kwargs)
    env_vars, fields = _runtimeenv.parse_runtime_env(kwargs.get("runtime_env"))
    os.environ.update(env_vars)  # the embedded node agent passes them on
    _raycontext.set_job_env_vars(dict(env_vars))  # the stand-in's remote() passes them on
    if fields:  # every actor and task of this job (and theirs) inherits them, as in Ray
        os.environ[_runtimeenv.ENV_KEY] = _runtimeenv.merged_env(fields)
    _raycontext.set_namespace(kwargs.get("namespace"))
    if is_initialized() and not ignore_reinit_error:
        raise RuntimeError("Maybe you called ray.init twice by accident? (pass ignore_reinit_error=True)")
    return _runtime.init(None if address in (None, "auto", "local") else address, num_cpus=num_cpus,
                         num_gpus=num_gpus, log_to_driver=kwargs.get("log_to_driver"),
                         resources=_init_resources(resources))


def _init_resources(value: Any) -> dict[str, float] | None:
    """``ray.init(resources=...)``: the embedded node's custom resources (ignored, as in Ray,
    when joining a running cluster: each node offers its own, ``podium node --resources``)."""
    if not value:
        return None
    if not isinstance(value, dict) or "CPU" in value or "GPU" in value:
        raise _errors.InvalidArgumentError(f"ray.init(resources=...) takes a dict of custom resources (num_cpus "
                                           f"and num_gpus give CPUs and GPUs), got {value!r}")
    from podium.resources import parse_custom_resources
    parse_custom_resources(value, what="ray.init(resources=...)")
    return {k: float(v) for k, v in value.items()}


def shutdown() -> None:
    """``ray.shutdown``."""
    _runtime.shutdown()


def is_initialized() -> bool:
    """``ray.is_initialized``: True after ``init`` (or the first call that joins the cluster),
    and, as in Ray, always in a worker, actor or task Podium started: such a process joins its
    own cluster on first use (``PODIUM_WORKER_ID`` is set there)."""
    return _runtime.is_initialized() or bool(os.environ.get("PODIUM_WORKER_ID"))


def get(object_refs: Any, *, timeout: float | None = None) -> Any:
    """``ray.get``: the value of a ref or a list of refs (``GetTimeoutError`` after ``timeout``)."""
    return _get(object_refs, timeout=timeout)


def put(value: Any, **kwargs: Any) -> _HeldRef:
    """``ray.put``: hold ``value`` here; its ref works wherever a result ref does.
    ``_tensor_transport`` is accepted: tensors travel through Podium's own data path (see
    docs/ray-options.md); ``_owner`` is refused."""
    _rayoptions.check("ray.put", _rayoptions.PUT, kwargs)
    return _put(value)


def wait(object_refs: list, *, num_returns: int = 1, timeout: float | None = None,
         fetch_local: bool = True) -> tuple[list, list]:
    """``ray.wait``: ``(ready, not_ready)``."""
    return _wait(object_refs, num_returns=num_returns, timeout=timeout)


def remote(*args: Any, **options: Any) -> Any:
    """``ray.remote``: a remote function or an actor class (with options)."""
    return _remote(*args, **options)


def method(*args: Any, **kwargs: Any) -> Any:
    """``ray.method``: the keywords :data:`podium.compat.rayoptions.METHOD` answers;
    ``concurrency_group`` puts the method in that group of its actor's ``concurrency_groups``;
    ``num_returns=N`` makes each call of it give N refs, ``num_returns="streaming"`` an
    :class:`ObjectRefGenerator` (as a generator method does by default), whose buffer at the
    worker ``_generator_backpressure_num_objects`` bounds; ``tensor_transport`` and
    ``enable_task_events`` are accepted with no effect, the rest are refused unless they ask for
    Ray's default."""
    from podium.controller.remote.returns import check_num_returns
    from podium.controller.remote.streams import Streaming, check_buffer
    from podium.worker.caller.streaming import BACKPRESSURE_ATTR, NUM_RETURNS_ATTR, STREAMING_RETURNS
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    if args:
        raise _errors.InvalidArgumentError("ray.method takes keyword arguments only (or one method)")
    _rayoptions.check("ray.method", _rayoptions.METHOD, kwargs)
    n = check_num_returns(kwargs.get("num_returns"))
    backpressure = kwargs.get("_generator_backpressure_num_objects")
    if backpressure is not None:
        check_buffer(backpressure)
    group = kwargs.get("concurrency_group")
    if group is not None:
        from podium.worker.actorshell import mark_group  # (checks the name now, at class definition)

        mark_group(lambda: None, group)

    def mark(fn: Any) -> Any:
        if kwargs.get("num_returns") is not None:  # (1 too: a generator method then returns one ref)
            setattr(fn, NUM_RETURNS_ATTR, STREAMING_RETURNS if type(n) is Streaming else n)
        if backpressure is not None:
            setattr(fn, BACKPRESSURE_ATTR, backpressure)
        return fn if group is None else mark_group(fn, group)
    return mark


def get_actor(name: str, namespace: str | None = None) -> Any:
    """``ray.get_actor``: the live actor called ``name`` (ValueError when there is none)."""
    try:
        return _get_actor(name, namespace or _raycontext.namespace_given())
    except _errors.NotFoundError as exc:
        raise _ActorNotFound(str(exc)) from None


class _ActorNotFound(_errors.NotFoundError, ValueError):
    """Ray raises ValueError for an unknown actor name; this is both."""


def kill(actor: Any, *, no_restart: bool = True) -> None:
    """``ray.kill``: stop an actor now."""
    _kill(actor, no_restart=no_restart)


def cancel(object_ref: Any, *, force: bool = False, recursive: bool = True) -> None:
    """``ray.cancel``: its ref raises TaskCancelledError from now on; a call already running in
    its worker is not interrupted (use ``force`` only through ``kill`` of its actor)."""
    if force:
        raise NotImplementedError("ray.cancel(force=True) is not supported: kill the actor instead")
    if not isinstance(object_ref, _PendingRef):
        raise _errors.InvalidArgumentError(f"cancel takes the ref of a call, got {type(object_ref).__name__}")
    object_ref.set_exception(_errors.CancelledError(f"{object_ref.method} was cancelled by ray.cancel"))


def timeline(filename: str | None = None) -> list[dict] | None:
    """``ray.timeline``: the session's Chrome trace events (written to ``filename`` as JSON
    when given); see :mod:`podium.controller.observe.timeline`."""
    from podium.controller.observe.timeline import timeline as podium_timeline
    return podium_timeline(filename)


def get_gpu_ids() -> list[int]:
    """``ray.get_gpu_ids``: the GPUs this process was given (CUDA_VISIBLE_DEVICES, or with
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``, which leaves that unnarrowed, the
    agent's ``PODIUM_ASSIGNED_GPUS``)."""
    text = os.environ.get("PODIUM_ASSIGNED_GPUS")
    if text is None:
        text = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [int(i) for i in text.split(",") if i.strip().isdigit()]


def _resources(available: bool) -> dict[str, float]:
    rt = _runtime.get_runtime()
    state = rt.run(rt.cluster_state(), timeout=60, what="cluster resources")
    alive = {n.info.node_id: n for n in state.nodes if n.state == 1}
    totals: dict[str, float] = {"CPU": 0.0, "GPU": 0.0}
    for node in alive.values():
        totals["CPU"] += node.info.cpus
        totals["GPU"] += len(node.info.gpus)
        totals[f"node:{node.info.address}"] = 1.0
        for name, amount in node.info.resources.items():
            totals[name] = totals.get(name, 0.0) + amount
    if available:
        for pg in state.placement_groups:
            if pg.state != 2 or not pg.placements:  # only PG_CREATED groups hold resources
                continue
            for placed in pg.placements:
                if placed.node_id in alive:
                    bundle = pg.bundles[placed.bundle_index].resources
                    for name, amount in bundle.items():
                        if name in totals and not name.startswith("node:"):
                            totals[name] -= amount
    return totals


def cluster_resources() -> dict[str, float]:
    """``ray.cluster_resources``: CPUs, GPUs and ``node:<address>`` of the alive nodes."""
    return _resources(False)


def available_resources() -> dict[str, float]:
    """``ray.available_resources``: the totals less what placement groups reserve."""
    return _resources(True)


def nodes() -> list[dict[str, Any]]:
    """``ray.nodes``: one dict per node (NodeID, Alive, NodeManagerAddress, Resources, and
    ObjectStoreSocketName: Podium has no plasma store; it is the path Ray's would have in the
    session folder whose ``logs`` Ray's ``LogMonitor`` follows, :mod:`podium.compat.raylogs`)."""
    from podium.compat.raylogs import object_store_socket_name

    rt = _runtime.get_runtime()
    state = rt.run(rt.cluster_state(), timeout=60, what="nodes")
    return [{"NodeID": n.info.node_id, "Alive": n.state == 1, "NodeManagerAddress": n.info.address,
             "NodeManagerHostname": n.info.hostname, "ObjectStoreSocketName": object_store_socket_name(),
             "Resources": {"CPU": n.info.cpus, "GPU": float(len(n.info.gpus)), f"node:{n.info.address}": 1.0,
                           **dict(n.info.resources)}}
            for n in state.nodes]


def _list_named_actors(all_namespaces: bool = False) -> list:
    rt = _runtime.get_runtime()
    state = rt.run(rt.cluster_state(), timeout=60, what="list_named_actors")
    namespace = _raycontext.namespace_given() or _options.DEFAULT_NAMESPACE
    out = []
    for w in state.workers:
        parts = w.spec.name.split(":", 2)  # a name may hold ":"
        if len(parts) == 3 and parts[0] == "actor" and w.state == 2:
            if all_namespaces:
                out.append({"name": parts[2], "namespace": parts[1]})
            elif parts[1] == namespace:
                out.append(parts[2])
    return out


#: ``ray.util``.
util = types.SimpleNamespace(
    placement_group=_placement.placement_group,
    remove_placement_group=_placement.remove_placement_group,
    get_placement_group=_placement.get_placement_group,
    get_current_placement_group=_placement.get_current_placement_group,
    list_named_actors=_list_named_actors,
    PlacementGroup=_placement.PlacementGroup,
    scheduling_strategies=types.SimpleNamespace(
        PlacementGroupSchedulingStrategy=_options.PlacementGroupSchedulingStrategy,
        NodeAffinitySchedulingStrategy=_options.NodeAffinitySchedulingStrategy),
    placement_group_table=None,
)
util.PlacementGroupSchedulingStrategy = _options.PlacementGroupSchedulingStrategy
util.NodeAffinitySchedulingStrategy = _options.NodeAffinitySchedulingStrategy
del util.placement_group_table

#: ``ray.exceptions``: every class of Ray's module, Podium's own where Podium raises it.
exceptions = types.SimpleNamespace(**{name: getattr(_rayexceptions, name)
                                      for name in (*_rayexceptions.NAMES, *_rayexceptions.OLDER_NAMES)})

#: Ray names Podium does not provide, with what to use instead.
_ALTERNATIVES = {
    "data": "DataProto batches passed to WorkerGroup calls",
    "train": "a WorkerGroup (podium.controller.WorkerGroup)",
    "tune": "a loop over WorkerGroup calls",
    "serve": "an actor that runs an HTTP server (podium.remote(cls))",
    "workflow": "plain Python control flow in the controller",
    "dag": "refs passed from one call to the next",
    "autoscaler": "starting more `podium node` processes",
    "actor": "podium.controller.ActorHandle",
    "get_dashboard_url": "the scheduler's HTTP dashboard (podium status prints its address)",
    "client": "init(address=...) on the controller machine",
    "job_config": "init() options",
    "cross_language": "Python workers only",
    "java_function": "Python workers only",
    "java_actor_class": "Python workers only",
    "get_actor_names": "util.list_named_actors()",
}


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    alternative = _ALTERNATIVES.get(name, "see the README's table of supported Ray names")
    # Both NotImplementedError and AttributeError: hasattr(), getattr(ray, name, default) and
    # unittest.mock (which probes names such as _is_coroutine_marker) treat it as absent.
    raise _errors.NotProvidedError(f"ray.{name} is not provided by podium.compat.ray; on Podium use: "
                                   f"{alternative}")
