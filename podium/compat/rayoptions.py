"""Every option and keyword of Ray 2.60's ``ray.init``, ``ray.remote``/``.options`` (actor and
task), ``placement_group``, ``ray.method``, an actor method's ``.options`` and ``ray.put``, with Podium's answer: honoured;
refused, naming the Podium alternative; or accepted with no effect, because it cannot matter on
Podium (the reason is given). Nothing is accepted and silently ignored.

``docs/ray-options.md`` is rendered from these tables (:func:`markdown`), and
``tests/unit/compat/test_ray_options.py`` checks them against Ray 2.60's keywords and against
what the stand-in accepts and refuses. The stand-in reads :data:`INIT`, :data:`METHOD` and
:data:`PUT` itself; actor and task options are enforced by
:mod:`podium.controller.remote.actoroptions`, whose refusal texts the ``refused`` notes repeat.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from podium.errors import InvalidArgumentError, UnimplementedError
from podium.runtimeenv import HONOURED_NOTE

__all__ = ["Answer", "HONOURED", "REFUSED", "NO_EFFECT", "RAY_VERSION", "INIT", "ACTOR", "TASK",
           "PLACEMENT_GROUP", "METHOD", "METHOD_CALL", "PUT", "TABLES", "check", "markdown"]

#: The Ray release these tables answer.
RAY_VERSION = "2.60.0"
HONOURED = "honoured"
REFUSED = "refused"
NO_EFFECT = "no effect"


@dataclasses.dataclass(frozen=True)
class Answer:
    """Podium's answer to one Ray keyword.

    ``note``: for ``honoured``, what Podium does; for ``refused``, the Podium alternative (the
    error says it); for ``no effect``, why it cannot matter. ``defaults``: values of a refused
    keyword that ask for nothing (Ray's defaults), so they are accepted. ``probe``: a value the
    tests pass (a refused keyword must be refused with it)."""

    verdict: str
    note: str
    probe: Any = True
    defaults: tuple = (None,)


def _ok(note: str, probe: Any = True) -> Answer:
    return Answer(HONOURED, note, probe)


def _no(note: str, probe: Any = True, defaults: tuple = (None,)) -> Answer:
    return Answer(REFUSED, note, probe, defaults)


def _moot(note: str, probe: Any = True) -> Answer:
    return Answer(NO_EFFECT, note, probe)


_NO_DAEMONS = "configures Ray's own daemons (raylet, GCS, dashboard), which Podium does not run"
_NO_PLASMA = "Podium has no shared object store: a value is held by the process that made it"
_RETURNS = ("N refs, one per item of the returned tuple or list; 'streaming' (a generator's default, as Ray): an "
            "ObjectRefGenerator whose refs come as the generator yields; 'dynamic' is refused (use 'streaming')")
_BACKPRESSURE = ("a streaming call's items held at the worker and not yet taken: its generator waits at its yield "
                 "beyond this many (default 1024; -1, Ray's 'no bound': 65,536)")
_PER_YIELD = "yield one item at a time (each yield is one ref)"

#: ``ray.init``.
INIT: dict[str, Answer] = {
    "address": _ok("the scheduler's host:port; None/'auto'/'local': PODIUM_ADDRESS, else an embedded cluster",
                   probe=None),
    "num_cpus": _ok("CPUs of the embedded cluster's node", probe=2),
    "num_gpus": _ok("GPUs of the embedded cluster's node", probe=0),
    "resources": _ok("custom resources of the embedded cluster's node (a running cluster's nodes offer "
                     "theirs: `podium node --resources`)", probe={"x": 1}),
    "labels": _no("NodeAffinitySchedulingStrategy on the node's address", probe={"zone": "a"}, defaults=(None, {})),
    "object_store_memory": _moot(_NO_PLASMA, probe=10**9),
    "local_mode": _no("run without local_mode: podium run starts a local cluster", defaults=(None, False)),
    "ignore_reinit_error": _ok("as Ray"),
    "include_dashboard": _moot("the scheduler always serves its HTTP dashboard (podium status prints it)"),
    "dashboard_host": _moot("the scheduler's HTTP port is set by `podium scheduler --http`", probe="0.0.0.0"),
    "dashboard_port": _moot("the scheduler's HTTP port is set by `podium scheduler --http`", probe=8265),
    "job_config": _no("init(runtime_env=..., namespace=...)", probe={"x": 1}),
    "configure_logging": _moot(_NO_DAEMONS),
    "logging_level": _moot(_NO_DAEMONS, probe="INFO"),
    "logging_format": _moot(_NO_DAEMONS, probe="%(message)s"),
    "logging_config": _moot(_NO_DAEMONS, probe="config"),
    "log_to_driver": _ok("workers' output is streamed to the driver, or not"),
    "namespace": _ok("the default namespace of named actors", probe="ns"),
    "runtime_env": _ok(f"{HONOURED_NOTE}, for every worker of the job (other keys are refused naming "
                       "the alternative)",
                       probe={"env_vars": {"A": "1"}}),
    "enable_resource_isolation": _no("run Podium's daemons on cores of their own (taskset)", defaults=(None, False)),
    "cgroup_path": _no("run Podium's daemons on cores of their own (taskset)", probe="/sys/fs/cgroup/x"),
    "system_reserved_cpu": _no("run Podium's daemons on cores of their own (taskset)", probe=1.0),
    "system_reserved_memory": _no("run Podium's daemons on cores of their own (taskset)", probe=10**9),
    "proxy_server_url": _no("init(address=...) on a machine that reaches the scheduler", probe="ray://x:1"),
    "_enable_object_reconstruction": _no("recompute a lost value by calling again (Podium keeps no lineage)",
                                         defaults=(None, False)),
    "_plasma_directory": _moot(_NO_PLASMA, probe="/tmp"),
    "_object_spilling_directory": _moot(_NO_PLASMA, probe="/tmp"),
    "_node_ip_address": _moot("the controller's address is found from its connection to the scheduler",
                              probe="127.0.0.1"),
    "_driver_object_store_memory": _moot(_NO_PLASMA, probe=10**9),
    "_memory": _no("num_cpus/num_gpus (Podium schedules CPUs and GPUs only)", probe=10**9),
    "_redis_username": _moot("Podium has no Redis; PODIUM_TOKEN authenticates", probe="u"),
    "_redis_password": _moot("Podium has no Redis; PODIUM_TOKEN authenticates", probe="p"),
    "_temp_dir": _moot("Ray's session directory; Podium's logs go where `podium run --log-dir` says", probe="/tmp"),
    "_metrics_export_port": _moot("the scheduler serves /metrics on its HTTP port", probe=8080),
    "_system_config": _moot("Ray's internal tunables; Podium's are PODIUM_* variables", probe={"x": 1}),
    "_tracing_startup_hook": _no("podium's timeline (ray.timeline())", probe="module:hook"),
    "_node_name": _moot("a display name of Ray's node; Podium names nodes by address", probe="n"),
    "_skip_env_hook": _moot("Ray's RAY_RUNTIME_ENV_HOOK is not read by Podium"),
    "allow_multiple": _no("one ray.init per process (shutdown() first)", defaults=(None, False)),
    "storage": _no("write to a shared filesystem yourself (Ray 2.48 removed it too)", probe="/tmp/s"),
}

# Shared between actors and tasks.
_COMMON: dict[str, Answer] = {
    "num_cpus": _ok("CPUs reserved (bounded by MAX_CPUS); 0 with no GPU or custom resource reserves 1/1000 CPU, "
                    "the least a Podium worker's bundle holds (Ray reserves nothing)", probe=1),
    "num_gpus": _ok("GPUs reserved; a fraction shares one GPU", probe=0.5),
    "memory": _ok("bytes of the `memory` resource each node offers (its physical memory)", probe=10**9),
    "accelerator_type": _no("a placement group on the nodes that have it", probe="H100"),
    "resources": _ok("custom resources, accounted like CPUs; node:<address> is node affinity", probe={"x": 1}),
    "label_selector": _no("NodeAffinitySchedulingStrategy or a placement group", probe={"zone": "a"},
                          defaults=(None, {})),
    "fallback_strategy": _no("a NodeAffinitySchedulingStrategy with soft=True", probe=[{"label_selector": {}}]),
    "object_store_memory": _moot(_NO_PLASMA, probe=10**9),
    "placement_group": _ok("runs in that placement group", probe="default"),
    "placement_group_bundle_index": _ok("runs in that bundle (-1: the first with room)", probe=0),
    "placement_group_capture_child_tasks": _ok(
        "what it starts without a placement of its own lands in its placement group"),
    "runtime_env": _ok(f"{HONOURED_NOTE}; other keys are refused",
                       probe={"env_vars": {"A": "1"}}),
    "scheduling_strategy": _ok("'DEFAULT', PlacementGroupSchedulingStrategy, NodeAffinitySchedulingStrategy "
                               "(soft too); 'SPREAD' is placed by Podium's scheduler, not spread", probe="DEFAULT"),
    "enable_task_events": _moot("Ray's task events feed its dashboard; Podium's timeline records every call",
                                probe=False),
    "_labels": _no("NodeAffinitySchedulingStrategy or a placement group", probe={"x": "y"}, defaults=(None, {})),
    "_metadata": _moot("Ray's internal per-class plugin data", probe={}),
    "node": _ok("Podium's own: run on the node with this id or address", probe=None),
}

#: ``@ray.remote`` / ``.options`` on a function.
TASK: dict[str, Answer] = {
    **_COMMON,
    "name": _moot("a task's name is only a label in Ray's dashboard", probe="t"),
    "max_calls": _no("an actor that you kill after N calls (task workers are pooled)", probe=2, defaults=(None, 0)),
    "max_retries": _ok("a task whose worker died runs again, up to N times (default 3, as Ray; -1: no limit)",
                       probe=3),
    "retry_exceptions": _ok("a task that raised (any, or these classes) runs again within max_retries"),
    "num_returns": _ok(_RETURNS, probe=2),
    "_generator_backpressure_num_objects": _ok(_BACKPRESSURE, probe=2),
    "_num_objects_per_yield": _no(_PER_YIELD, probe=2, defaults=(None, 1)),
}

#: ``@ray.remote`` / ``.options`` on a class.
ACTOR: dict[str, Answer] = {
    **_COMMON,
    "name": _ok("a named actor (ray.get_actor finds it)", probe="a"),
    "namespace": _ok("the named actor's namespace", probe="ns"),
    "lifetime": _ok("'detached' outlives the driver", probe="detached"),
    "get_if_exists": _ok("returns the live actor of that name"),
    "max_concurrency": _ok("calls run at once (threads, or event-loop slots for async methods)", probe=4),
    "concurrency_groups": _ok("each group has its own limit and threads (an async actor: its own event loop, "
                              "in a thread of its own); the default group keeps max_concurrency", probe={"io": 2}),
    "max_restarts": _ok("a dead actor is built again by its owner, same name and handles (README: Actor "
                        "restarts)", probe=2),
    "max_task_retries": _ok("a call in flight when the actor died is sent again after its restart", probe=2),
    "max_pending_calls": _no("bound the calls in flight in the caller", probe=10, defaults=(None, -1)),
    "allow_out_of_order_execution": _no("max_concurrency > 1, or async methods", defaults=(None, False)),
    "enable_tensor_transport": _moot(
        "tensors travel through Podium's data path (see the RDT note below)"),
    "_actor_generator_backpressure_num_objects": _no("_generator_backpressure_num_objects on each streaming call",
                                                     probe=2, defaults=(None, -1)),
}

#: ``ray.util.placement_group``.
PLACEMENT_GROUP: dict[str, Answer] = {
    "bundles": _ok("each bundle's CPU and GPU are reserved", probe=[{"CPU": 1}]),
    "strategy": _ok("PACK, SPREAD, STRICT_PACK, STRICT_SPREAD", probe="PACK"),
    "name": _ok("get_placement_group finds it", probe="pg"),
    "lifetime": _ok("'detached' outlives the driver", probe="detached"),
    "_soft_target_node_id": _no("NodeAffinitySchedulingStrategy(soft=True) for the group's workers", probe="n"),
    "bundle_label_selector": _no("`podium node` per kind of machine and a placement group per kind",
                                 probe=[{"zone": "a"}], defaults=(None, [], ())),
    "topology_strategy": _no("STRICT_PACK (one node) or a NodeAffinitySchedulingStrategy", probe={"x": "y"}),
    "_max_cpu_fraction_per_node": _moot("removed from Ray (2.10); Podium never reserves CPUs for Ray's daemons",
                                        probe=0.5),
}

#: ``@ray.method``.
METHOD: dict[str, Answer] = {
    "num_returns": _ok(_RETURNS, probe=2),
    "concurrency_group": _ok("the method runs in that group of its actor's concurrency_groups", probe="io"),
    "max_task_retries": _ok("this call is sent again after the actor's restart, up to N times", probe=2),
    "retry_exceptions": _ok("this call is sent again when it raised (any, or these classes), within "
                            "max_task_retries"),
    "_generator_backpressure_num_objects": _ok(_BACKPRESSURE, probe=2),
    "_num_objects_per_yield": _no(_PER_YIELD, probe=2, defaults=(None, 1)),
    "enable_task_events": _moot("Ray's task events feed its dashboard; Podium's timeline records every call",
                                probe=False),
    "tensor_transport": _moot("tensors travel through Podium's data path (see the RDT note below)",
                              probe="nixl"),
}

#: ``handle.method.options(...)``: one call's options.
METHOD_CALL: dict[str, Answer] = {
    "name": _moot("a call's name is only a label in Ray's dashboard", probe="c"),
    "num_returns": _ok(_RETURNS, probe=2),
    "max_task_retries": _ok("this call is sent again after the actor's restart, up to N times", probe=2),
    "retry_exceptions": _ok("this call is sent again when it raised (any, or these classes), within "
                            "max_task_retries"),
    "concurrency_group": _ok("this call runs in that group of its actor's concurrency_groups", probe="io"),
    "_generator_backpressure_num_objects": _ok(_BACKPRESSURE, probe=2),
    "_num_objects_per_yield": _no(_PER_YIELD, probe=2, defaults=(None, 1)),
    "enable_task_events": _moot("Ray's task events feed its dashboard; Podium's timeline records every call",
                                probe=False),
    "tensor_transport": _moot("tensors travel through Podium's data path (see the RDT note below)",
                              probe="nccl"),
    "_labels": _no("NodeAffinitySchedulingStrategy or a placement group", probe={"x": "y"}),
}

#: ``ray.put``.
PUT: dict[str, Answer] = {
    "_owner": _no("put the value in the process that should own it (a ref lives as long as its owner)",
                  probe="actor"),
    "_tensor_transport": _moot("tensors travel through Podium's data path (see the RDT note below)",
                               probe="nixl"),
}

#: Every table, by the Ray API it answers.
TABLES: dict[str, dict[str, Answer]] = {
    "ray.init": INIT,
    "ray.remote / .options (actor)": ACTOR,
    "ray.remote / .options (task)": TASK,
    "ray.util.placement_group": PLACEMENT_GROUP,
    "ray.method": METHOD,
    "handle.method.options": METHOD_CALL,
    "ray.put": PUT,
}


def _is_default(answer: Answer, value: Any) -> bool:
    return any(value is d or (type(value) is type(d) and value == d) for d in answer.defaults)


def check(api: str, table: dict[str, Answer], given: dict[str, Any]) -> None:
    """Refuse what ``table`` refuses in ``given`` (an UnimplementedError naming the
    alternative) and any keyword it does not know (InvalidArgumentError)."""
    for key, value in given.items():
        answer = table.get(key)
        if answer is None:
            raise InvalidArgumentError(f"{api}() got an unknown keyword {key!r} (Ray {RAY_VERSION} has no such "
                                       f"keyword; see docs/ray-options.md)")
        if answer.verdict == REFUSED and not _is_default(answer, value):
            raise UnimplementedError(f"{api}({key}={value!r}) is not supported by Podium: {answer.note}")


def markdown() -> str:
    """The tables as Markdown (the body of docs/ray-options.md between its markers)."""
    lines: list[str] = []
    for api, table in TABLES.items():
        lines += [f"### `{api}`", "", "| keyword | answer | note |", "|---|---|---|"]
        for key in sorted(table):
            answer = table[key]
            lines.append(f"| `{key}` | {answer.verdict} | {answer.note.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m podium.compat.rayoptions: the docs table's body
    print(markdown())
