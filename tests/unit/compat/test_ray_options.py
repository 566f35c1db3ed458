"""Nothing Ray-shaped is silently ignored (issue #49 item 11): every keyword of Ray 2.60's
``ray.init``, ``ray.remote``/``.options`` (actor and task), ``placement_group``, ``ray.method``
and ``ray.put`` has an answer in :mod:`podium.compat.rayoptions`; every keyword the stand-in
accepts is in the table; each ``refused`` one is refused by the stand-in with the alternative
and each ``honoured`` or ``no effect`` one is accepted; docs/ray-options.md shows the table.

No cluster is started: the stand-in checks its options before it joins one.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest
from podium.controller.remote import actoroptions, placement
from podium.controller.remote.actors import ActorMethod
from podium.errors import InvalidArgumentError, UnimplementedError

from podium.compat import ray as compat
from podium.compat import rayoptions, standin
from podium.compat.rayoptions import HONOURED, NO_EFFECT, REFUSED

# Ray 2.60.0's keywords, read from its wheel (ray-2.60.0, python/ray/_private/worker.py's
# init signature and kwargs.pop calls; ray/_common/ray_option_utils.py's _common_options,
# _task_only_options and _actor_only_options; ray/util/placement_group.py's placement_group;
# ray/actor.py's method valid_kwargs; worker.py's put).
RAY_VERSION = "2.60.0"
RAY_INIT = {
    "address", "num_cpus", "num_gpus", "resources", "labels", "object_store_memory", "local_mode",
    "ignore_reinit_error", "include_dashboard", "dashboard_host", "dashboard_port", "job_config",
    "configure_logging", "logging_level", "logging_format", "logging_config", "log_to_driver", "namespace",
    "runtime_env", "enable_resource_isolation", "cgroup_path", "system_reserved_cpu", "system_reserved_memory",
    "proxy_server_url",
    # popped from **kwargs
    "_enable_object_reconstruction", "_plasma_directory", "_object_spilling_directory", "_node_ip_address",
    "_driver_object_store_memory", "_memory", "_redis_username", "_redis_password", "_temp_dir",
    "_metrics_export_port", "_system_config", "_tracing_startup_hook", "_node_name", "_skip_env_hook",
    "allow_multiple", "storage",
}
RAY_COMMON = {
    "label_selector", "fallback_strategy", "accelerator_type", "memory", "name", "num_cpus", "num_gpus",
    "object_store_memory", "placement_group", "placement_group_bundle_index",
    "placement_group_capture_child_tasks", "resources", "runtime_env", "scheduling_strategy",
    "enable_task_events", "_labels",
}
RAY_TASK = RAY_COMMON | {"max_calls", "max_retries", "num_returns", "retry_exceptions",
                         "_generator_backpressure_num_objects", "_num_objects_per_yield"}
RAY_ACTOR = RAY_COMMON | {"concurrency_groups", "enable_tensor_transport", "lifetime", "max_concurrency",
                          "max_restarts", "max_task_retries", "max_pending_calls", "namespace", "get_if_exists",
                          "allow_out_of_order_execution", "_actor_generator_backpressure_num_objects"}
RAY_PLACEMENT_GROUP = {"bundles", "strategy", "name", "lifetime", "_soft_target_node_id", "bundle_label_selector",
                       "topology_strategy"}
RAY_METHOD = {"num_returns", "concurrency_group", "max_task_retries", "retry_exceptions",
              "_generator_backpressure_num_objects", "_num_objects_per_yield", "enable_task_events",
              "tensor_transport"}
RAY_PUT = {"_owner", "_tensor_transport"}
# ray/actor.py's ActorMethod._remote keywords (what handle.method.options(...) passes on).
RAY_METHOD_CALL = {"name", "num_returns", "max_task_retries", "retry_exceptions", "concurrency_group",
                   "_generator_backpressure_num_objects", "_num_objects_per_yield", "enable_task_events",
                   "tensor_transport", "_labels"}

RAY_KEYWORDS = {
    "ray.init": (RAY_INIT, rayoptions.INIT),
    "actor": (RAY_ACTOR, rayoptions.ACTOR),
    "task": (RAY_TASK, rayoptions.TASK),
    "placement_group": (RAY_PLACEMENT_GROUP, rayoptions.PLACEMENT_GROUP),
    "ray.method": (RAY_METHOD, rayoptions.METHOD),
    "ray.put": (RAY_PUT, rayoptions.PUT),
    "handle.method.options": (RAY_METHOD_CALL, rayoptions.METHOD_CALL),
}


class Plain:
    """An actor class for the option checks."""

    def ping(self) -> int:
        """Answer."""
        return 1


def plain() -> int:
    """A task for the option checks."""
    return 1


def test_the_tables_follow_the_ray_version_listed_here():
    assert rayoptions.RAY_VERSION == RAY_VERSION


@pytest.mark.parametrize("api", sorted(RAY_KEYWORDS))
def test_every_ray_keyword_has_an_answer(api):
    keywords, table = RAY_KEYWORDS[api]
    missing = sorted(keywords - set(table))
    assert not missing, f"{api}: Ray {RAY_VERSION} keywords without an answer in podium.compat.rayoptions: {missing}"
    for key, answer in table.items():
        assert answer.verdict in (HONOURED, REFUSED, NO_EFFECT), (api, key)
        assert answer.note.strip(), (api, key)


def _compared_strings(function) -> set[str]:
    """The string constants a function compares ``key`` with (its accepted option names)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "key":
            for right in node.comparators:
                for const in ast.walk(right):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        out.add(const.value)
    return out


def test_every_option_the_stand_in_accepts_is_in_the_table():
    # Actor and task options: those parse_options names, refuses or ignores.
    accepted = (_compared_strings(actoroptions.parse_options) | set(actoroptions._UNSUPPORTED)
                | set(actoroptions._IGNORED))
    assert not accepted - set(rayoptions.ACTOR) - set(rayoptions.TASK), "options without an answer"
    per_call = set(actoroptions._CALL_REFUSED) | actoroptions._CALL_NO_EFFECT | actoroptions._CALL_HONOURED
    assert per_call == set(rayoptions.METHOD_CALL)
    # placement_group: its parameters and the keywords it lets through **kwargs.
    params = set(inspect.signature(placement.placement_group).parameters) - {"kwargs"}
    tree = ast.parse(textwrap.dedent(inspect.getsource(placement._check_kwargs)))
    let_through = {c.value for n in ast.walk(tree) if isinstance(n, ast.Set) for c in n.elts
                   if isinstance(c, ast.Constant)}
    assert not (params | let_through | set(placement._REFUSED)) - set(rayoptions.PLACEMENT_GROUP)
    # ray.init's named parameters; the rest of its keywords go through the table's check.
    init_params = set(inspect.signature(compat.init).parameters) - {"kwargs"}
    assert not init_params - set(rayoptions.INIT)
    for call in (lambda: compat.init(no_such_keyword=1), lambda: compat.method(no_such_keyword=1),
                 lambda: compat.put(1, no_such_keyword=1), lambda: standin.remote(no_such_keyword=1)(Plain),
                 lambda: placement.placement_group([{"CPU": 1}], no_such_keyword=1),
                 lambda: ActorMethod(None, "ping").options(no_such_keyword=1)):
        with pytest.raises(InvalidArgumentError, match="no_such_keyword"):
            call()


def _refusal_checks():
    for key, answer in rayoptions.INIT.items():
        yield "ray.init", key, answer, lambda kw: compat.init(**kw)
    for key, answer in rayoptions.ACTOR.items():
        yield "actor", key, answer, lambda kw: standin.remote(**kw)(Plain)
    for key, answer in rayoptions.TASK.items():
        yield "task", key, answer, lambda kw: standin.remote(**kw)(plain)
    for key, answer in rayoptions.METHOD.items():
        yield "ray.method", key, answer, lambda kw: compat.method(**kw)(Plain.ping)
    for key, answer in rayoptions.PUT.items():
        yield "ray.put", key, answer, lambda kw: compat.put(1, **kw)
    for key, answer in rayoptions.METHOD_CALL.items():
        yield "handle.method.options", key, answer, lambda kw: ActorMethod(None, "ping").options(**kw)
    for key, answer in rayoptions.PLACEMENT_GROUP.items():
        yield "placement_group", key, answer, lambda kw: placement.placement_group([{"CPU": 1}], **kw)


REFUSALS = [(api, key, answer, call) for api, key, answer, call in _refusal_checks() if answer.verdict == REFUSED]


@pytest.mark.parametrize("api,key,answer,call", REFUSALS, ids=[f"{a}:{k}" for a, k, _, _ in REFUSALS])
def test_every_refused_option_is_refused_with_its_alternative(api, key, answer, call):
    with pytest.raises(UnimplementedError) as raised:
        call({key: answer.probe})
    assert key in str(raised.value) and answer.note in str(raised.value), str(raised.value)


def test_refused_options_at_rays_default_ask_for_nothing_and_are_accepted():
    for api, key, answer, call in REFUSALS:
        if api in ("ray.init", "ray.put", "placement_group"):
            continue  # accepted there means a cluster starts: checked below without one
        for default in answer.defaults:
            call({key: default})
    for api, table in (("ray.init", rayoptions.INIT), ("ray.put", rayoptions.PUT)):
        for key, answer in table.items():
            if answer.verdict == REFUSED:
                for default in answer.defaults:
                    rayoptions.check(api, table, {key: default})
    for key in placement._REFUSED:
        placement._check_kwargs({key: None})


def test_every_honoured_or_no_effect_option_is_accepted():
    for api, key, answer, call in _refusal_checks():
        if answer.verdict == REFUSED:
            continue
        if api in ("ray.init", "ray.put"):
            # The calls themselves start a cluster; the check they make first is the table's.
            table = rayoptions.INIT if api == "ray.init" else rayoptions.PUT
            rayoptions.check(api, table, {key: answer.probe})
        elif api == "placement_group":
            if key in inspect.signature(placement.placement_group).parameters:
                continue  # a named parameter of Podium's placement_group
            placement._check_kwargs({key: answer.probe})
        else:
            call({key: answer.probe})


def test_the_docs_table_is_the_modules_table():
    doc = (Path(__file__).parents[3] / "docs" / "ray-options.md").read_text()
    begin, end = "<!-- rayoptions:begin -->\n", "<!-- rayoptions:end -->"
    assert begin in doc and end in doc
    shown = doc.split(begin, 1)[1].split(end, 1)[0]
    assert shown.strip() == rayoptions.markdown().strip(), "regenerate: python -m podium.compat.rayoptions"
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    assert "docs/ray-options.md" in readme
