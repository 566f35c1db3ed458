"""The options of ``podium.remote`` actors and tasks (Ray's ``.options(...)``), checked once.

Every count has a bound and every unknown or unsupported option is refused with an error
that names it: :class:`~podium.errors.InvalidArgumentError` for a bad value, and
``NotImplementedError`` (an :class:`~podium.errors.UnimplementedError`) naming the Podium
alternative for a Ray option Podium does not provide.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

from podium.errors import InvalidArgumentError, InvalidSpecError, UnimplementedError
from podium.resources import SYSTEM_ENV_KEYS, parse_custom_resources
from podium.runtimeenv import RuntimeFields, parse_runtime_env, spec_kwargs
from podium.worker.actorshell import MAX_CONCURRENCY, check_groups

__all__ = ["check_call_options", "Options", "PlacementGroupSchedulingStrategy", "NodeAffinitySchedulingStrategy",
           "parse_options", "runtime_spec_fields", "MAX_CPUS", "MAX_GPUS", "DEFAULT_NAMESPACE",
           "MAX_RETRY_COUNT", "DEFAULT_TASK_RETRIES", "retry_count", "retry_exceptions", "captured",
           "CURRENT_PG_ENV", "CAPTURE_ENV"]

#: Largest num_cpus / num_gpus one actor or task may ask for.
MAX_CPUS = 1024.0
MAX_GPUS = 64.0
#: Namespace of named actors when none is given (shared by every controller of a cluster).
DEFAULT_NAMESPACE = "default"
#: Longest actor name / namespace accepted.
_MAX_NAME = 200
#: Largest max_restarts / max_task_retries / max_retries accepted (-1: no limit).
MAX_RETRY_COUNT = 100_000
#: Ray's default max_retries of a task: a task whose worker died runs again up to 3 times.
DEFAULT_TASK_RETRIES = 3

#: Ray options Podium does not provide, and what to use instead.
_UNSUPPORTED = {
    "accelerator_type": "a placement group on the nodes that have it",
    "label_selector": "NodeAffinitySchedulingStrategy or a placement group",
    "_labels": "NodeAffinitySchedulingStrategy or a placement group",
    "fallback_strategy": "a NodeAffinitySchedulingStrategy with soft=True",
    "max_calls": "an actor that you kill after N calls (task workers are pooled)",
    "max_pending_calls": "bound the calls in flight in the caller",
    "allow_out_of_order_execution": "max_concurrency > 1, or async methods",
    "_num_objects_per_yield": "yield one item at a time (each yield is one ref)",
    "_actor_generator_backpressure_num_objects": "_generator_backpressure_num_objects on each streaming call",
}
#: Accepted with no effect, each for a reason in docs/ray-options.md (podium.compat.rayoptions):
#: tensors travel through Podium's data path whatever ``enable_tensor_transport`` says, and
#: Podium has no object store for ``object_store_memory`` to size.
_IGNORED = {"_metadata", "enable_task_events", "enable_tensor_transport", "object_store_memory"}
#: Ray's default values of options in _UNSUPPORTED, besides None: they ask for nothing.
_DEFAULT_VALUES = {"label_selector": ({},), "_labels": ({},),
                   "max_calls": (0,), "max_pending_calls": (-1,), "allow_out_of_order_execution": (False,),
                   "fallback_strategy": (), "_num_objects_per_yield": (1,),
                   "_actor_generator_backpressure_num_objects": (-1,)}
#: Set by Podium in a worker placed in a placement group: the group's id (what
#: ``get_current_placement_group`` returns) and, with capture, "1" (what it starts lands there too).
CURRENT_PG_ENV = "PODIUM_PLACEMENT_GROUP"
CAPTURE_ENV = "PODIUM_PLACEMENT_GROUP_CAPTURE"
#: Options of _UNSUPPORTED whose None asks for nothing beyond CPUs and GPUs: accepted.
_NONE_IS_DEFAULT = {"accelerator_type"}


class PlacementGroupSchedulingStrategy:
    """Ray's strategy object: run in bundle ``placement_group_bundle_index`` of a placement
    group (-1: the first bundle with room)."""

    def __init__(self, placement_group: Any, placement_group_bundle_index: int = -1,
                 placement_group_capture_child_tasks: bool | None = None) -> None:
        self.placement_group = placement_group
        self.placement_group_bundle_index = placement_group_bundle_index
        self.placement_group_capture_child_tasks = placement_group_capture_child_tasks


class NodeAffinitySchedulingStrategy:
    """Ray's strategy object: run on node ``node_id`` (a Podium node id or node address);
    ``soft=True`` falls back to any node when that one can never hold it."""

    def __init__(self, node_id: str, soft: bool = False, _spill_on_unavailable: bool = False,
                 _fail_on_unavailable: bool = False) -> None:
        self.node_id = node_id
        self.soft = soft


@dataclasses.dataclass
class Options:
    """Checked options of one actor or task."""

    name: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    detached: bool = False
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_concurrency: int | None = None
    #: Ray's ``concurrency_groups``: group name -> its limit (None: none declared).
    concurrency_groups: dict[str, int] | None = None
    placement_group: Any = None
    bundle_index: int = -1
    node: str | None = None
    #: With ``node``: fall back to any node when that one cannot hold it (Ray's ``soft``).
    node_soft: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    #: runtime_env variables Podium sets itself in a worker (RANK, MASTER_ADDR...): the
    #: actor's process sets them just before it builds the class (Ray lets them be given).
    process_env: dict[str, str] = dataclasses.field(default_factory=dict)
    get_if_exists: bool = False
    #: runtime_env's py_executable / working_dir / py_modules given here (podium.runtimeenv);
    #: a key absent is inherited from the creating process (:func:`runtime_spec_fields`).
    runtime: RuntimeFields = dataclasses.field(default_factory=RuntimeFields)
    #: Actors: how often a dead actor is constructed again (-1: no limit; Ray's max_restarts).
    max_restarts: int = 0
    #: Actors: how often a call that met the actor's death is sent again after its restart.
    max_task_retries: int = 0
    #: Tasks: how often a task whose worker died runs again (Ray's default: 3).
    max_retries: int = DEFAULT_TASK_RETRIES
    #: Tasks (and actor calls): which exceptions the function raises are retried too, within
    #: max_retries (max_task_retries): False none, True all, or a tuple of classes.
    retry_exceptions: Any = False
    #: ``num_returns``: refs per call, or a ``Streaming`` (``"streaming"``); None: Ray's default
    #: (a generator function streams, any other returns one ref).
    num_returns: Any = None
    #: Tasks: ``_generator_backpressure_num_objects``, a streaming call's buffer at the worker.
    backpressure: int | None = None
    #: ``placement_group_capture_child_tasks``: what this actor or task starts lands in its group.
    capture_child_tasks: bool = False
    #: The placement (group, node or strategy) was given, so a parent's capture does not apply.
    placement_given: bool = False
    #: Custom resources (``resources={...}``, and ``memory`` in bytes), taken like num_cpus.
    resources: dict[str, float] = dataclasses.field(default_factory=dict)


def _amount(key: str, value: Any, bound: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(f"{key} must be a number, got {value!r}")
    if not 0 <= value <= bound:
        raise InvalidArgumentError(f"{key} must be in [0, {bound:g}], got {value!r}")
    if key == "num_gpus" and value > 1 and value != int(value):
        raise InvalidArgumentError(f"num_gpus must be a fraction in (0, 1] or a whole number, got {value!r}")
    return float(value)


def _text(key: str, value: Any, colon: bool = False) -> str:
    # A namespace may not hold ':' (it ends at the first one in "actor:<namespace>:<name>");
    # a name may (verl names its workers "<prefix><Class>_<pg>:<rank>").
    if not isinstance(value, str) or not value or len(value) > _MAX_NAME or (":" in value and not colon):
        raise InvalidArgumentError(f"{key} must be a non-empty string of at most {_MAX_NAME} characters"
                                   f"{'' if colon else ' without :'}, got {value!r}")
    return value


def parse_options(given: dict[str, Any], *, actor: bool, base: Options | None = None) -> Options:
    """``Options`` from Ray-style keyword options (on top of ``base``)."""
    opts = dataclasses.replace(base) if base is not None else Options()
    opts.env = dict(opts.env)
    opts.process_env = dict(opts.process_env)
    opts.runtime = RuntimeFields(opts.runtime)
    opts.resources = dict(opts.resources)
    for key, value in given.items():
        if key in _UNSUPPORTED:
            if key in _NONE_IS_DEFAULT and value is None:
                continue  # no accelerator asked for: Ray's default
            if key in _DEFAULT_VALUES and (value is None or any(type(value) is type(d) and value == d
                                                                for d in _DEFAULT_VALUES[key])):
                continue
            raise UnimplementedError(f"ray option {key}={value!r} is not supported by Podium: {_UNSUPPORTED[key]}")
        if key in _IGNORED:
            continue
        if key == "num_cpus":
            opts.num_cpus = _amount(key, value, MAX_CPUS)
        elif key == "num_gpus":
            opts.num_gpus = _amount(key, value, MAX_GPUS)
        elif key in ("resources", "memory"):
            _custom(opts, key, value)
        elif key == "name" and actor:
            opts.name = None if value is None else _text(key, value, colon=True)
        elif key == "name":
            continue  # a task's name is only a label in Ray's dashboard
        elif key == "namespace" and actor:
            opts.namespace = DEFAULT_NAMESPACE if value is None else _text(key, value)
        elif key == "lifetime" and actor:
            if value not in (None, "detached", "non_detached"):
                raise InvalidArgumentError(f"lifetime must be None, 'detached' or 'non_detached', got {value!r}")
            opts.detached = value == "detached"
        elif key == "max_concurrency" and actor:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= MAX_CONCURRENCY):
                raise InvalidArgumentError(f"max_concurrency must be an int in [1, {MAX_CONCURRENCY}], "
                                           f"got {value!r}")
            opts.max_concurrency = value
        elif key == "concurrency_groups" and actor:
            opts.concurrency_groups = None if value is None else check_groups(value)
        elif key in ("max_restarts", "max_task_retries") and actor:
            setattr(opts, key, retry_count(key, value))
        elif key == "max_retries" and not actor:
            opts.max_retries = retry_count(key, value, none=DEFAULT_TASK_RETRIES)
        elif key == "retry_exceptions":
            opts.retry_exceptions = retry_exceptions(value)
        elif key == "get_if_exists" and actor:
            opts.get_if_exists = bool(value)
        elif key == "num_returns":
            from podium.controller.remote.returns import check_num_returns
            opts.num_returns = check_num_returns(value)
            if actor and opts.num_returns != 1:
                raise InvalidArgumentError("num_returns is an option of tasks and actor methods "
                                           "(@ray.method(num_returns=N), handle.method.options(num_returns=N))")
        elif key == "_generator_backpressure_num_objects" and not actor:
            from podium.worker.caller.streaming import check_buffer
            if value is not None:
                check_buffer(value)
            opts.backpressure = value
        elif key == "placement_group_capture_child_tasks":
            opts.capture_child_tasks = bool(value)
        elif key == "placement_group":
            opts.placement_group = None if value == "default" else value
            opts.placement_given = value != "default"
        elif key == "placement_group_bundle_index":
            opts.bundle_index = _index(value)
        elif key == "scheduling_strategy":
            _strategy(opts, value)
        elif key == "node":
            opts.node = None if value is None else str(value)
            opts.placement_given = opts.placement_given or value is not None
        elif key == "runtime_env":
            env, fields = parse_runtime_env(value)
            opts.runtime.update(fields)
            own = {k: v for k, v in env.items() if k in SYSTEM_ENV_KEYS and not k.startswith("PODIUM_")}
            opts.env.update({k: v for k, v in env.items() if k not in own})
            opts.process_env.update(own)
        else:
            raise InvalidArgumentError(f"unknown {'actor' if actor else 'task'} option {key!r}")
    return opts


#: Ray's per-call options (``handle.method.options(...)``) Podium does not provide, with the
#: values that ask for nothing (Ray's defaults) and the alternative.
_CALL_REFUSED = {
    "_num_objects_per_yield": ((None, 1), "yield one item at a time (each yield is one ref)"),
    "_labels": ((None,), "NodeAffinitySchedulingStrategy or a placement group"),
}
#: Per-call options with no effect on Podium (a call's name is a dashboard label; tensors take
#: Podium's data path; Podium's timeline records every call).
_CALL_NO_EFFECT = {"name", "tensor_transport", "enable_task_events"}
#: Per-call options ``ActorMethod.options`` honours itself before this check.
_CALL_HONOURED = {"concurrency_group", "max_task_retries", "retry_exceptions", "num_returns",
                  "_generator_backpressure_num_objects"}


def check_call_options(given: dict[str, Any]) -> None:
    """Check Ray's per-call options of an actor method: refused ones (unless at Ray's default)
    raise UnimplementedError naming the alternative, unknown ones InvalidArgumentError."""
    for key, value in given.items():
        if key in _CALL_NO_EFFECT or key in _CALL_HONOURED:
            continue
        if key not in _CALL_REFUSED:
            raise InvalidArgumentError(f"unknown actor method option {key!r}")
        defaults, alternative = _CALL_REFUSED[key]
        if not any(value is d or (type(value) is type(d) and value == d) for d in defaults):
            raise UnimplementedError(f"ray option {key}={value!r} is not supported by Podium: {alternative}")


def retry_count(key: str, value: Any, none: int = 0) -> int:
    """A checked max_restarts / max_task_retries / max_retries: an int in [-1, MAX_RETRY_COUNT]
    (-1: no limit); None gives ``none`` (Ray's default)."""
    if value is None:
        return none
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= MAX_RETRY_COUNT:
        raise InvalidArgumentError(f"{key} must be an int in [-1, {MAX_RETRY_COUNT}] (-1: no limit), got {value!r}")
    return value


def retry_exceptions(value: Any) -> Any:
    """A checked retry_exceptions: a bool, or a list/tuple of exception classes (a tuple)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(c, type) and issubclass(c, BaseException) for c in value):
        return tuple(value)
    raise InvalidArgumentError(f"retry_exceptions must be a bool or a non-empty list of exception classes, "
                               f"got {value!r}")


def _custom(opts: Options, key: str, value: Any) -> None:
    """``resources={...}`` (custom resources; ``CPU``/``GPU`` are refused there, as Ray does)
    or ``memory=bytes``; ``node:<address>`` in ``resources`` pins the node, as node affinity."""
    if key == "memory":
        value = {"memory": 0 if value is None else value}
    elif value is None:
        value = {}
    elif not isinstance(value, dict):
        raise InvalidArgumentError(f"resources must be a dict of resource name to amount, got {value!r}")
    else:
        if "CPU" in value or "GPU" in value:
            raise InvalidArgumentError("use num_cpus and num_gpus, not resources={'CPU'/'GPU': ...}")
        nodes = [k for k in value if isinstance(k, str) and k.startswith("node:")]
        if len(nodes) > 1 or (nodes and not nodes[0][5:]):
            raise InvalidArgumentError(f"resources: at most one 'node:<address>' key, got {nodes}")
        if nodes:
            opts.node = nodes[0][5:]
        value = {k: v for k, v in value.items() if k not in nodes}
    # As in Ray, ``resources`` replaces the custom resources given before (``memory`` stays).
    kept = {k: v for k, v in opts.resources.items() if k == "memory"} if key == "resources" else opts.resources
    merged = {**kept, **value}
    try:
        parse_custom_resources(merged, what=key)
    except InvalidSpecError as exc:
        raise InvalidArgumentError(exc.message) from None
    opts.resources = {k: float(v) for k, v in merged.items() if v}


def _index(value: Any) -> int:
    # Any integer type, as Ray: verl computes bundle indices with numpy (split_resource_pool).
    try:
        index = -2 if isinstance(value, bool) else operator.index(value)
    except TypeError:
        index = -2
    if index < -1:
        raise InvalidArgumentError(f"placement_group_bundle_index must be an int >= -1, got {value!r}")
    return index


def _strategy(opts: Options, value: Any) -> None:
    if value is None or value in ("DEFAULT", "SPREAD"):
        return  # the scheduler's own placement
    if isinstance(value, PlacementGroupSchedulingStrategy):
        opts.placement_group = value.placement_group  # None: explicitly no group (no capture)
        opts.bundle_index = _index(value.placement_group_bundle_index)
        opts.placement_given = True
        if value.placement_group_capture_child_tasks is not None:
            opts.capture_child_tasks = bool(value.placement_group_capture_child_tasks)
    elif isinstance(value, NodeAffinitySchedulingStrategy):
        opts.node = str(value.node_id)
        opts.node_soft = bool(value.soft)
        opts.placement_given = True
    else:
        raise InvalidArgumentError(f"scheduling_strategy must be 'DEFAULT', 'SPREAD', a "
                                   f"PlacementGroupSchedulingStrategy or a NodeAffinitySchedulingStrategy, "
                                   f"got {value!r}")


def runtime_spec_fields(opts: Options | None = None) -> dict[str, Any]:
    """The ``WorkerSpec`` keyword arguments (python_command, working_dir, py_modules) of a
    worker created here with ``opts`` (:func:`podium.runtimeenv.spec_kwargs`)."""
    return spec_kwargs(opts.runtime if opts is not None else None)


def captured(opts: Options, env: dict[str, str] | Any) -> Options:
    """``opts`` for an actor or task started by a process whose environment is ``env``: in the
    caller's placement group (any bundle, capturing in turn) when the caller was placed with
    ``placement_group_capture_child_tasks`` and ``opts`` name no placement of their own, as Ray;
    then, when it is in a placement group, with :data:`CURRENT_PG_ENV` (and :data:`CAPTURE_ENV`)
    in its environment."""
    parent = env.get(CURRENT_PG_ENV)
    if parent and env.get(CAPTURE_ENV) == "1" and not opts.placement_given and opts.placement_group is None:
        opts = dataclasses.replace(opts, placement_group=parent, bundle_index=-1, capture_child_tasks=True)
    pg_id = getattr(opts.placement_group, "id", opts.placement_group)
    if not isinstance(pg_id, str):
        return opts  # no group, or a bad one (refused where it is reserved)
    extra = {CURRENT_PG_ENV: pg_id}
    if opts.capture_child_tasks:
        extra[CAPTURE_ENV] = "1"
    return dataclasses.replace(opts, env={**opts.env, **extra})
