"""What the ``ray`` stand-in (``podium/compat/raypath/ray``) adds to :mod:`podium.compat.ray`:
the Ray names verl 0.9.1 reads beyond the public API (``ray._private.state``,
``ray.experimental.state.api.get_actor``, ``ray.util.get_node_ip_address``,
``ray.util.placement_group_table``), ``remote`` that carries the stand-in's path to workers,
and the error for names not provided. (``podium run --num-cpus/--num-gpus`` size the embedded
cluster in :func:`podium.controller.session.runtime.init`, whichever call starts it.)
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

from podium.compat import ray as _compat
from podium.compat.activation import RAYPATH
from podium.compat.raycontext import job_env_vars, node_ip_address
from podium.controller.remote.actoroptions import (
    Options,
    PlacementGroupSchedulingStrategy,
    parse_options,
)
from podium.controller.remote.tasks import RemoteFunction
from podium.errors import NotProvidedError

__all__ = [
    "NotProvidedFinder",
    "actor_state",
    "available_resources_per_node",
    "get_node_ip_address",
    "missing",
    "placement_group_table",
    "remote",
    "timeline",
]

_STRATEGY_NAMES = {1: "PACK", 2: "SPREAD", 3: "STRICT_PACK", 4: "STRICT_SPREAD"}
_PG_STATES = {1: "PENDING", 2: "CREATED", 3: "REMOVED"}


def missing(ray_name: str, alternative: str) -> NoReturn:
    """Raise the stand-in's error for a Ray name Podium does not provide:
    :class:`~podium.errors.NotProvidedError`, a ``NotImplementedError`` that is also an
    ``AttributeError`` (``hasattr``, ``getattr(x, name, default)`` and ``unittest.mock``'s
    probes see a missing name), naming the alternative."""
    if ray_name.rsplit(".", 1)[-1].startswith("__"):
        raise AttributeError(ray_name)  # dunder probes (copy, pickle, inspect) are not Ray API
    raise NotProvidedError(f"{ray_name} is not provided by Podium's ray stand-in; on Podium use: {alternative}")


class NotProvidedFinder:
    """A meta path finder, last on ``sys.meta_path``, for ``ray.*`` modules that neither the
    stand-in nor anything else provides: importing one (``import ray.data``, ``from ray import
    serve``) raises ``ModuleNotFoundError`` with the stand-in's message naming the Podium
    alternative, where Python would otherwise say only "cannot import name"."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        """Raise for a ``ray.*`` module the stand-in does not provide; None for any other."""
        import sys

        parent_name, _, last = fullname.rpartition(".")
        parent = sys.modules.get(parent_name)
        if not fullname.startswith("ray.") or not getattr(sys.modules.get("ray"), "__podium__", False) \
                or parent is None or last.startswith("__"):
            return None
        try:
            getattr(parent, last)
        except NotProvidedError as exc:
            # name=None: importlib's from-list handling swallows a ModuleNotFoundError that
            # names the module, and Python would then print its own, vaguer message.
            raise ModuleNotFoundError(str(exc)) from None
        except AttributeError:
            return None
        return None


def _worker_env() -> dict[str, str]:
    """The environment a worker on any node needs so its ``import ray`` is the stand-in too,
    with ``ray.init``'s ``runtime_env`` ``env_vars`` (Ray's job-level runtime_env)."""
    path = os.environ.get("PYTHONPATH", "")
    own = {"PYTHONPATH": path} if RAYPATH in path.split(os.pathsep) else {"PYTHONPATH": RAYPATH}
    return {**job_env_vars(), **own}


class _BundleTask(RemoteFunction):
    """A remote function whose ``.options`` placing it in a placement group bundle takes no
    CPU of that bundle unless ``num_cpus`` is given: Podium's task workers are pooled and
    outlive the task, and would keep the CPU that Ray frees when the task ends (verl runs a
    task in bundle 0 and then an actor that needs all of it)."""

    def options(self, **options: Any) -> _BundleTask:
        """Ray's ``.options``, as :meth:`RemoteFunction.options`."""
        placed = isinstance(options.get("scheduling_strategy"), PlacementGroupSchedulingStrategy) \
            or options.get("placement_group") not in (None, "default")
        if placed and "num_cpus" not in options and self._options.num_cpus == Options.num_cpus:
            options["num_cpus"] = 0
        return _BundleTask(self._function, parse_options(options, actor=False, base=self._options))


def remote(*args: Any, **options: Any) -> Any:
    """``ray.remote``: :func:`podium.compat.ray.remote`, with the stand-in's ``PYTHONPATH`` in
    every worker's environment (workers of a cluster started elsewhere do not inherit it)."""
    env = _worker_env()
    if len(args) == 1 and not options and callable(args[0]):
        made = _compat.remote(runtime_env={"env_vars": env})(args[0])
    else:
        given = dict(options.get("runtime_env") or {})
        given["env_vars"] = {**env, **(given.get("env_vars") or {})}
        options["runtime_env"] = given
        made = _compat.remote(*args, **options)
    if not hasattr(made, "remote"):  # remote(**options) gave a decorator
        return lambda target: _wrap_made(made(target))
    return _wrap_made(made)


def _wrap_made(made: Any) -> Any:
    return _BundleTask(made._function, made._options) if type(made) is RemoteFunction else made


def timeline(filename: str | None = None) -> list[dict] | None:
    """``ray.timeline``: the session's Chrome trace (:func:`podium.controller.observe.timeline.timeline`)."""
    from podium.controller.observe.timeline import timeline as podium_timeline
    return podium_timeline(filename)


def get_node_ip_address() -> str:
    """``ray.util.get_node_ip_address``: the address of the node this process runs on (a
    worker's node; in the controller, the address workers reach it on)."""
    return node_ip_address()


def _state() -> Any:
    from podium.controller.session import runtime

    rt = runtime.get_runtime()
    return rt.run(rt.cluster_state(), timeout=60, what="cluster state")


def _table_entry(pg: Any) -> dict[str, Any]:
    return {"placement_group_id": pg.id, "name": pg.name, "strategy": _STRATEGY_NAMES.get(pg.strategy, "PACK"),
            "state": _PG_STATES.get(pg.state, "PENDING"),
            "bundles": {i: dict(b.resources) for i, b in enumerate(pg.bundles)},
            "bundles_to_node_id": {p.bundle_index: p.node_id for p in pg.placements},
            "is_detached": pg.detached}


def placement_group_table(placement_group: Any = None) -> dict[str, Any]:
    """``ray.util.placement_group_table`` (and ``ray._private.state.state.placement_group_table``):
    one group's entry (``bundles``, ``bundles_to_node_id``, ``state``, ``strategy``...), given the
    group or its id, else every group's by id. The node ids are ``ray.nodes()``'s ``NodeID``."""
    groups = {pg.id: pg for pg in _state().placement_groups}
    if placement_group is None:
        return {pg_id: _table_entry(pg) for pg_id, pg in groups.items()}
    pg_id = getattr(placement_group, "id", placement_group)
    if pg_id not in groups:
        return {"placement_group_id": pg_id, "state": "REMOVED", "bundles": {}, "bundles_to_node_id": {}}
    return _table_entry(groups[pg_id])


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """``ray._private.state.available_resources_per_node``: node id -> CPU/GPU not reserved by
    a placement group (and ``node:<address>``), for alive nodes."""
    state = _state()
    out: dict[str, dict[str, float]] = {}
    for node in state.nodes:
        if node.state == 1:
            out[node.info.node_id] = {"CPU": float(node.info.cpus), "GPU": float(len(node.info.gpus)),
                                      f"node:{node.info.address}": 1.0, **dict(node.info.resources)}
    for pg in state.placement_groups:
        if pg.state != 2:
            continue
        for placed in pg.placements:
            free = out.get(placed.node_id)
            if free is not None:
                bundle = pg.bundles[placed.bundle_index].resources
                for name, amount in bundle.items():
                    if name in free and not name.startswith("node:"):
                        free[name] -= amount
    return out


def actor_state(actor_id: str) -> dict[str, Any] | None:
    """``ray.experimental.state.api.get_actor``: ``{"actor_id", "name", "state", "node_id", "pid"}``
    of the actor whose ``handle._actor_id.hex()`` is ``actor_id``, or None."""
    from podium.controller.session import runtime
    from podium.errors import NotFoundError

    rt = runtime.get_runtime()
    try:
        infos = rt.run(rt.scheduler.get_workers(names=[actor_id]), timeout=60, what="get_actor state")
    except NotFoundError:
        return None
    if not infos:
        return None
    info = infos[0]
    state = {1: "PENDING_CREATION", 2: "ALIVE"}.get(info.state, "DEAD")
    return {"actor_id": actor_id, "name": info.spec.name.split(":", 2)[-1], "state": state,
            "node_id": getattr(info, "node_id", ""), "pid": getattr(info, "pid", 0)}
