"""What a process knows about itself under Ray's names: ``ray.get_runtime_context()`` and
``ray._private.worker.global_worker`` (``mode``, ``gcs_client.address``, ``node``), for the
``ray`` stand-in.

In the controller (the driver) the answers come from its runtime; in a worker Podium started
(``PODIUM_WORKER_ID`` is set) from the worker's environment and, once, its own record at the
scheduler (its spec: name, CPUs, GPUs, placement group). The ``gcs_address`` is the
scheduler's address: it is what ``ray.init(address=...)`` takes on Podium.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import threading
from typing import Any

from podium import runtimeenv
from podium.compat.rayruntimeenv import RuntimeEnv
from podium.controller.remote import actoroptions as _options
from podium.controller.session import runtime as _runtime

__all__ = ["set_namespace", "namespace_given", "set_job_env_vars", "job_env_vars", "node_ip_address", "in_worker", "scheduler_address",
           "RuntimeContext", "get_runtime_context", "Worker", "GcsClient", "Node", "global_worker",
           "SCRIPT_MODE", "WORKER_MODE", "SPILL_WORKER_MODE", "RESTORE_WORKER_MODE", "LOCAL_MODE"]

#: Ray 2.60's process modes (``ray._private.worker``): the driver, and a worker.
SCRIPT_MODE = 0
WORKER_MODE = 1
SPILL_WORKER_MODE = 2
RESTORE_WORKER_MODE = 3
#: Ray's local mode (removed in Ray 2.45, where its value was 2); a Podium process is never in it.
LOCAL_MODE = 2

#: The namespace ``ray.init(namespace=...)`` gave (None: the default namespace).
_namespace: str | None = None


def set_namespace(namespace: str | None) -> None:
    """Record ``ray.init``'s ``namespace`` (the default of named actors from now on)."""
    global _namespace
    _namespace = namespace


#: ``ray.init(runtime_env={"env_vars": ...})``: set in every worker the stand-in's ``remote``
#: starts, on any cluster (Ray's job-level runtime_env), under the actor's or task's own.
_job_env_vars: dict[str, str] = {}


def set_job_env_vars(env_vars: dict[str, str]) -> None:
    """Record ``ray.init``'s ``runtime_env["env_vars"]`` for the workers started from now on."""
    _job_env_vars.clear()
    _job_env_vars.update(env_vars)


def job_env_vars() -> dict[str, str]:
    """The ``env_vars`` of ``ray.init``'s ``runtime_env`` (a copy)."""
    return dict(_job_env_vars)


def namespace_given() -> str | None:
    """The namespace ``ray.init`` gave, or None."""
    return _namespace


def node_ip_address() -> str:
    """The address of the node this process runs on (a worker's node; in the controller, the
    address workers reach it on): ``ray.util.get_node_ip_address``."""
    here = os.environ.get("PODIUM_NODE_ADDRESS")
    if here:
        return here
    from podium.controller.session.objects import controller_host

    if _runtime.is_initialized():
        rt = _runtime.get_runtime()
        return controller_host(rt.address, embedded=rt.embedded)
    return controller_host(os.environ.get("PODIUM_ADDRESS") or "127.0.0.1:1", embedded=False)


#: The actor class that runs ``@ray.remote`` functions in Podium's task pools: a worker
#: hosting it is a task worker, not an actor (Ray's ``get_actor_id`` is None in a task).
_TASK_RUNNER_PREFIX = "actor:TaskRunner-"


def in_worker() -> bool:
    """True in a process Podium started for an actor, task or worker group rank."""
    return bool(os.environ.get("PODIUM_WORKER_ID"))


def scheduler_address() -> str:
    """The scheduler's ``host:port`` this process talks to ("" before ``ray.init`` in a
    driver that starts an embedded cluster)."""
    if _runtime.is_initialized():
        return _runtime.get_runtime().address
    return os.environ.get("PODIUM_ADDRESS") or os.environ.get("PODIUM_SCHEDULER") or ""


@functools.lru_cache(maxsize=1)
def _own_info() -> Any:
    """This worker's WorkerInfo at the scheduler (asked once: a worker's spec does not change)."""
    rt = _runtime.get_runtime()
    infos = rt.run(rt.scheduler.get_workers(ids=[os.environ["PODIUM_WORKER_ID"]]), timeout=60,
                   what="this worker's record")
    return infos[0] if infos else None


class RuntimeContext:
    """``ray.get_runtime_context()``: ids of this job, node, worker and actor, and what it was
    given. Where Podium has no such id the answer says so (see each method)."""

    def get_job_id(self) -> str:
        """The controller's session id (Podium's job); a worker's ``PODIUM_JOB_ID`` if set."""
        if _runtime.is_initialized():
            return _runtime.get_runtime().session_id
        return os.environ.get("PODIUM_JOB_ID", "")

    def get_node_id(self) -> str:
        """The id of the node this process runs on (the first node when it runs on none)."""
        if in_worker():
            info = _own_info()
            if info is not None and info.node_id:
                return info.node_id
            return os.environ.get("PODIUM_NODE_ADDRESS", "")
        rt = _runtime.get_runtime()
        state = rt.run(rt.cluster_state(), timeout=60, what="get_node_id")
        from podium.controller.session.objects import controller_host
        here = controller_host(rt.address, embedded=rt.embedded)
        alive = [n for n in state.nodes if n.state == 1]
        for node in alive:
            if node.info.address == here:
                return node.info.node_id
        return alive[0].info.node_id if alive else ""

    def get_worker_id(self) -> str:
        """This worker's id (``PODIUM_WORKER_ID``); in the controller, its session id."""
        return os.environ.get("PODIUM_WORKER_ID") or self.get_job_id()

    def get_actor_id(self) -> str | None:
        """The actor this process hosts, as ``handle._actor_id.hex()`` names it; None in the
        controller and in a task worker, as in Ray."""
        if not in_worker():
            return None
        info = _own_info()
        name = info.spec.name if info is not None else ""
        return name if name and not name.startswith(_TASK_RUNNER_PREFIX) else None

    def get_actor_name(self) -> str | None:
        """The name the actor was created with (``options(name=...)``), else None."""
        actor_id = self.get_actor_id() or ""
        parts = actor_id.split(":", 2)
        if len(parts) == 3 and parts[0] == "actor":
            return parts[2]
        return None

    def get_task_id(self) -> str | None:
        """An id of the running thread of this process. Podium's calls carry no cluster-wide
        task id, so this names where the code runs (worker and thread), not one call."""
        return f"{self.get_worker_id()}-{threading.get_ident():x}"

    def get_placement_group_id(self) -> str | None:
        """The placement group this worker runs in, else None."""
        if not in_worker():
            return None
        info = _own_info()
        return (info.spec.placement_group_id or None) if info is not None else None

    def get_assigned_resources(self) -> dict[str, float]:
        """``{"CPU": n, "GPU": n}`` this worker was given (the controller: nothing)."""
        if not in_worker():
            return {}
        info = _own_info()
        if info is None:
            return {}
        out = {"CPU": float(info.spec.num_cpus)}
        if info.spec.num_gpus:
            out["GPU"] = float(info.spec.num_gpus)
        return out

    def get_accelerator_ids(self) -> dict[str, list[str]]:
        """``{"GPU": [...]}`` this process sees (``CUDA_VISIBLE_DEVICES``)."""
        text = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return {"GPU": [i.strip() for i in text.split(",") if i.strip().isdigit()]}

    def was_current_actor_reconstructed(self) -> bool:
        """False: an actor Podium started again is a new actor (``max_restarts`` aside)."""
        return False

    def get_runtime_env_string(self) -> str:
        """:attr:`runtime_env` as JSON."""
        return json.dumps(self.runtime_env.to_dict(), sort_keys=True)

    @property
    def runtime_env(self) -> RuntimeEnv:
        """The runtime_env this process runs under (Ray's ``RuntimeEnv``): what Podium passes
        on to the actors and tasks it starts (``py_executable``, ``working_dir``,
        ``py_modules``, ``pip``/``uv``) and ``ray.init``'s ``env_vars``."""
        fields = runtimeenv.inherited()
        env = RuntimeEnv(working_dir=fields.get("working_dir") or None,
                         py_modules=list(fields["py_modules"]) if fields.get("py_modules") else None,
                         env_vars=job_env_vars() or None)
        if fields.get("py_executable"):
            env["py_executable"] = shlex.join(fields["py_executable"])
        if fields.get("pip"):
            pip = fields["pip"]
            env[pip["installer"]] = {"packages": list(pip["packages"]),
                                     **({"pip_check": pip["pip_check"], "pip_version": pip["pip_version"]}
                                        if pip["installer"] == "pip" else {"uv_check": pip["pip_check"]})}
        return env

    @property
    def job_id(self) -> str:
        """Same as :meth:`get_job_id`."""
        return self.get_job_id()

    @property
    def node_id(self) -> str:
        """Same as :meth:`get_node_id`."""
        return self.get_node_id()

    @property
    def actor_id(self) -> str | None:
        """Same as :meth:`get_actor_id`."""
        return self.get_actor_id()

    @property
    def task_id(self) -> str | None:
        """Same as :meth:`get_task_id`."""
        return self.get_task_id()

    @property
    def current_placement_group_id(self) -> str | None:
        """Same as :meth:`get_placement_group_id`."""
        return self.get_placement_group_id()

    @property
    def gcs_address(self) -> str:
        """The scheduler's address (Podium's counterpart of Ray's GCS)."""
        return scheduler_address()

    @property
    def worker(self) -> Worker:
        """``global_worker`` (ROLL reads ``get_runtime_context().worker.mode``)."""
        return global_worker

    @property
    def namespace(self) -> str:
        """The default namespace of named actors."""
        return _namespace or _options.DEFAULT_NAMESPACE


def get_runtime_context() -> RuntimeContext:
    """``ray.get_runtime_context``."""
    return RuntimeContext()


class GcsClient:
    """``global_worker.gcs_client``: only its ``address`` (the scheduler's)."""

    @property
    def address(self) -> str:
        """The scheduler's ``host:port``."""
        return scheduler_address()


class Node:
    """``global_worker.node``: the addresses Ray code reads off the local node."""

    @property
    def node_ip_address(self) -> str:
        """This node's address (``ray.util.get_node_ip_address``)."""
        return node_ip_address()

    @property
    def address(self) -> str:
        """The scheduler's address (Ray: the GCS address)."""
        return scheduler_address()

    @property
    def gcs_address(self) -> str:
        """Same as :attr:`address`."""
        return scheduler_address()

    @property
    def unique_id(self) -> str:
        """This node's id."""
        return RuntimeContext().get_node_id()


class Worker:
    """``ray._private.worker.global_worker``: the process's mode, scheduler client and node."""

    gcs_client = GcsClient()
    node = Node()

    @property
    def mode(self) -> int | None:
        """``WORKER_MODE`` in a worker, ``SCRIPT_MODE`` in a connected driver, None before
        ``ray.init`` (as Ray)."""
        if in_worker():
            return WORKER_MODE
        return SCRIPT_MODE if _runtime.is_initialized() else None

    @property
    def connected(self) -> bool:
        """Whether this process has joined a cluster (always, in a worker)."""
        return in_worker() or _runtime.is_initialized()

    @property
    def namespace(self) -> str:
        """The default namespace of named actors."""
        return RuntimeContext().namespace

    @property
    def current_job_id(self) -> str:
        """The controller's session id."""
        return RuntimeContext().get_job_id()

    @property
    def worker_id(self) -> str:
        """This worker's id."""
        return RuntimeContext().get_worker_id()


#: ``ray._private.worker.global_worker``.
global_worker = Worker()
