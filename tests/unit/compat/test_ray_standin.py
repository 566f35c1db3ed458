"""The ``ray`` stand-in (podium/compat/raypath/ray) forwards every usage form verl 0.9.1 has to
Podium, raises NotImplementedError (naming the Podium alternative) for the rest, and is
``ray`` only where ``podium run`` / ``podium.compat.activate`` put it on the path.

These need no verl and start no cluster: the forms are resolved in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import ClassVar

import pytest
from podium.errors import InvalidArgumentError
from podium.controller.remote.actoroptions import parse_options
from podium.controller.remote.actors import ActorClass

from podium.compat.activation import RAYPATH, activated_env

#: The 16 forms of issue 29 and the rest of what verl 0.9.1 imports from ray, as verl writes them.
FORMS = """
import ray
assert ray.__podium__ and ray.__file__.startswith(RAYPATH), ray.__file__
from ray.actor import ActorHandle, ActorClass
assert ray.actor.ActorHandle is ActorHandle and ray.actor.ActorClass is ActorClass
assert callable(ray.util.get_node_ip_address)
import ray.util.collective as collective
for name in ("init_collective_group", "broadcast", "barrier", "destroy_collective_group", "is_group_initialized"):
    assert callable(getattr(collective, name)), name
assert collective.is_group_initialized("nothing") is False
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util import placement_group_table, list_named_actors
assert ray.util.placement_group is placement_group and callable(placement_group_table)
from ray.experimental.state.api import get_actor
assert callable(get_actor)
assert callable(ray._private.state.state.placement_group_table)
assert callable(ray._private.state.available_resources_per_node)
from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
assert isinstance(RAY_JOB_CONFIG_JSON_ENV_VAR, str)
assert ray.cloudpickle.loads(ray.cloudpickle.dumps(lambda x: x + 1))(1) == 2
import pickle
assert ray.cloudpickle.pickle is pickle  # as Ray's vendored copy exports it
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy
assert ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy is PlacementGroupSchedulingStrategy
for name in ("init", "get", "put", "wait", "remote", "get_actor", "kill", "cancel", "nodes", "get_gpu_ids",
             "get_runtime_context", "is_initialized", "shutdown", "available_resources", "cluster_resources"):
    assert callable(getattr(ray, name)), name
assert ray.ObjectRef and ray.exceptions.RayActorError and ray.exceptions.GetTimeoutError
import inspect
assert list(inspect.signature(ray.timeline).parameters) == ["filename"]  # Ray's signature
for where, name in ((ray, "data"), (ray.util, "multiprocessing"), (ray.actor, "exit_actor"), (collective, "reduce"),
                    (ray.experimental, "tqdm_ray"), (ray._private, "usage")):
    try:
        getattr(where, name)
    except NotImplementedError as exc:
        assert name in str(exc) and "on Podium use" in str(exc), exc
    else:
        raise AssertionError(f"{where.__name__}.{name} resolved")
try:
    collective.create_collective_group([], 2, [0, 1])
except NotImplementedError as exc:
    assert "init_collective_group" in str(exc)
print("FORMS OK")
"""


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, check=False, capture_output=True, text=True, timeout=120)


def test_every_verl_usage_form_resolves_under_the_stand_in():
    env = activated_env({k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    done = _python(f"RAYPATH = {RAYPATH!r}\n" + FORMS, env)
    assert done.returncode == 0 and "FORMS OK" in done.stdout, done.stderr[-3000:]


def test_without_activation_import_ray_is_never_the_stand_in():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = _python("import importlib.util, sys\n"
                   "spec = importlib.util.find_spec('ray')\n"
                   "print('none' if spec is None else spec.origin)\n", env)
    assert done.returncode == 0, done.stderr
    assert "raypath" not in done.stdout


def test_activate_puts_the_stand_in_first_in_the_process_and_for_its_workers():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = _python("import os, podium.compat\n"
                   "podium.compat.activate(address='127.0.0.1:7', num_cpus=3, num_gpus=1)\n"
                   "import ray\n"
                   "print(ray.__podium__, os.environ['PYTHONPATH'].split(os.pathsep)[0] == podium.compat.activation.RAYPATH,"
                   " os.environ['PODIUM_ADDRESS'], os.environ['PODIUM_RAY_NUM_CPUS'], os.environ['PODIUM_RAY_NUM_GPUS'])\n",
                   env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True", "127.0.0.1:7", "3", "1"]


def test_activated_env_keeps_the_rest_of_pythonpath_once():
    out = activated_env({"PYTHONPATH": os.pathsep.join(["/a", RAYPATH, "/b"])})
    assert out["PYTHONPATH"].split(os.pathsep) == [RAYPATH, "/a", "/b"]
    assert "PODIUM_ADDRESS" not in out


def test_podium_run_passes_the_exit_status_and_the_stand_in_to_the_command():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--", sys.executable, "-c",
                           "import sys, ray; sys.exit(3 if ray.__podium__ else 1)"],
                          env=env, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]


def test_podium_run_without_a_command_is_a_usage_error():
    done = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--"], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "give the command to run after --" in done.stderr


def test_runtime_env_variables_podium_sets_itself_go_to_the_actors_process():
    opts = parse_options({"runtime_env": {"env_vars": {"RANK": "3", "MASTER_PORT": "29500", "MY_FLAG": "1"}}},
                         actor=True)
    assert opts.env == {"MY_FLAG": "1"}
    assert opts.process_env == {"RANK": "3", "MASTER_PORT": "29500"}
    with pytest.raises(Exception, match="PODIUM_TOKEN"):
        from podium.resources import check_user_env
        check_user_env(parse_options({"runtime_env": {"env_vars": {"PODIUM_TOKEN": "x"}}}, actor=True).env)


def test_runtime_env_keys_set_to_none_ask_for_the_default_and_others_are_refused():
    # verl's trainer passes working_dir=None and py_executable=None: Ray's defaults, Podium's too.
    opts = parse_options({"runtime_env": {"env_vars": {"A": "1"}, "working_dir": None, "py_executable": None}},
                         actor=True)
    assert opts.env == {"A": "1"}
    assert not opts.runtime
    for key in ("conda", "container", "nsight"):
        with pytest.raises(NotImplementedError, match=f"runtime_env key '{key}' is not supported by Podium: "):
            parse_options({"runtime_env": {key: ["x"]}}, actor=True)
    uris = {"working_dir": "gcs://_ray_pkg_0123456789abcdef.zip", "py_modules": ["https://example.org/m.zip"]}
    assert parse_options({"runtime_env": uris}, actor=True).runtime == {
        "working_dir": uris["working_dir"], "py_modules": tuple(uris["py_modules"])}  # fetched by the node
    for scheme in ("s3", "gs", "http", "file"):
        with pytest.raises(NotImplementedError, match=f"gcs://_ray_pkg_<hash>.zip.*not {scheme}://"):
            parse_options({"runtime_env": {"working_dir": f"{scheme}://bucket/x.zip"}}, actor=True)
    from podium.errors import InvalidArgumentError
    for bad in ("gcs://other.zip", "https://example.org/x.tar", "https://example.org/a b.zip"):
        with pytest.raises(InvalidArgumentError, match="not a package URI"):
            parse_options({"runtime_env": {"working_dir": bad}}, actor=True)


def test_runtime_env_py_executable_working_dir_and_py_modules_are_checked_and_bounded(tmp_path):
    from podium.errors import InvalidArgumentError
    from podium.runtimeenv import MAX_COMMAND_CHARS, MAX_PY_MODULES
    (tmp_path / "mod.py").write_text("")
    opts = parse_options({"runtime_env": {"py_executable": "uv run --frozen --extra vllm python",
                                          "working_dir": str(tmp_path), "py_modules": [str(tmp_path / "mod.py")]}},
                         actor=True)
    assert opts.runtime == {"py_executable": ("uv", "run", "--frozen", "--extra", "vllm", "python"),
                            "working_dir": str(tmp_path), "py_modules": (str(tmp_path / "mod.py"),)}
    for bad in ({"py_executable": "x" * (MAX_COMMAND_CHARS + 1)}, {"py_executable": "python 'unclosed"},
                {"py_executable": ""}, {"working_dir": str(tmp_path / "absent")},
                {"py_modules": [str(tmp_path)] * (MAX_PY_MODULES + 1)}, {"py_modules": [str(tmp_path / "absent")]}):
        with pytest.raises(InvalidArgumentError):
            parse_options({"runtime_env": bad}, actor=True)


def test_runtime_env_pip_and_uv_in_rays_forms_become_one_sorted_set(tmp_path, monkeypatch):
    from podium import runtimeenv
    from podium.errors import InvalidArgumentError
    listed = parse_options({"runtime_env": {"pip": ["b==2", " a ", "b==2"]}}, actor=True).runtime["pip"]
    assert listed == {"installer": "pip", "packages": ("a", "b==2"), "pip_check": False, "pip_version": ""}
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# pinned\nb==2\n\na  # first\n")
    assert parse_options({"runtime_env": {"pip": str(requirements)}}, actor=True).runtime["pip"] == listed
    as_dict = parse_options({"runtime_env": {"pip": {"packages": ["a", "b==2"], "pip_check": True,
                                                     "pip_version": "==23.2.1"}}}, actor=True).runtime["pip"]
    assert as_dict == {**listed, "pip_check": True, "pip_version": "==23.2.1"}
    uv = parse_options({"runtime_env": {"uv": {"packages": ["a"], "uv_check": True}}}, actor=True).runtime["pip"]
    assert uv == {"installer": "uv", "packages": ("a",), "pip_check": True, "pip_version": ""}
    assert hash(uv) == hash(runtimeenv.PipFields(uv))  # task pools key on it
    for bad in ({"pip": []}, {"pip": [f"x{i}" for i in range(runtimeenv.MAX_PIP_PACKAGES + 1)]}, {"pip": 3},
                {"pip": ["a\nb"]}, {"pip": {"packages": ["a"], "pip_install_options": ["-U"]}},
                {"pip": str(tmp_path / "absent.txt")}, {"pip": ["a"], "uv": ["a"]},
                {"pip": ["a"], "py_executable": "python3"}, {"pip": {"packages": ["a"], "pip_check": "yes"}}):
        with pytest.raises(InvalidArgumentError):
            parse_options({"runtime_env": bad}, actor=True)
    # A child's own pip replaces an inherited py_executable (one process, one interpreter).
    monkeypatch.setenv(runtimeenv.ENV_KEY, runtimeenv.to_env(("python3",), "", ()))
    kwargs = runtimeenv.spec_kwargs({"pip": listed})
    assert kwargs["python_command"] == [] and kwargs["pip"]["packages"] == ["a", "b==2"]
    monkeypatch.setenv(runtimeenv.ENV_KEY, runtimeenv.to_env((), "", (), listed))
    assert runtimeenv.inherited()["pip"] == listed
    assert "pip" not in runtimeenv.spec_kwargs({"py_executable": ("python3",)})


def test_native_verl_mode_is_asked_for_in_the_environment_and_inherited_by_workers():
    plain = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PODIUM_NATIVE_VERL")}
    assert "PODIUM_NATIVE_VERL" not in activated_env(plain)
    assert activated_env(plain, native_verl=True)["PODIUM_NATIVE_VERL"] == "1"
    # Without verl installed the finder is still installed by the stand-in, and only serves
    # verl.single_controller.ray: every other import is untouched.
    done = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--native-verl", "--", sys.executable, "-c",
                           "import os, sys, ray, json\n"
                           "from podium.compat import nativeverl\n"
                           "print(os.environ['PODIUM_NATIVE_VERL'], nativeverl.installed(),"
                           " nativeverl._FINDER.find_spec('json', None) is None)"],
                          env=plain, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "True", "True"]


def test_a_bundle_index_may_be_any_integer_type_as_in_ray():
    # verl's split_resource_pool computes the bundle indices of its sub-pools with numpy.
    import numpy as np

    from podium.controller.remote.actoroptions import PlacementGroupSchedulingStrategy

    assert parse_options({"placement_group_bundle_index": np.int64(3)}, actor=True).bundle_index == 3
    strategy = PlacementGroupSchedulingStrategy("pg-1", placement_group_bundle_index=np.int32(2))
    opts = parse_options({"scheduling_strategy": strategy}, actor=True)
    assert opts.bundle_index == 2 and type(opts.bundle_index) is int
    for bad in (True, 1.0, "0", np.int64(-2)):
        with pytest.raises(ValueError, match="placement_group_bundle_index must be an int >= -1"):
            parse_options({"placement_group_bundle_index": bad}, actor=True)


def test_actor_names_may_hold_colons_but_namespaces_may_not():
    assert parse_options({"name": "pfxWorker_0:1"}, actor=True).name == "pfxWorker_0:1"
    with pytest.raises(ValueError, match="namespace"):
        parse_options({"namespace": "a:b"}, actor=True)


class _Registered:
    """A class with a class attribute and a method, as verl's workers have."""

    raw_cls_dict: ClassVar[dict[str, type]] = {"role": int}

    def work(self) -> int:
        return 1


def test_an_actor_class_shows_its_class_attributes_as_rays_does():
    actor_class = ActorClass(_Registered)
    assert "work" in dir(actor_class) and actor_class.work.__func__ is _Registered.work
    # A method comes back bound, as through Ray's ActorClass (an instance of a subclass of the
    # class): cloudpickle then pickles the methods of an installed module's actor class by
    # value, and the actor's process does not import that module to build it.
    assert actor_class.work is not _Registered.work
    import cloudpickle
    assert actor_class.work.__self__ is actor_class and cloudpickle.loads(cloudpickle.dumps(_Registered))
    assert actor_class.raw_cls_dict == {"role": int}
    with pytest.raises(AttributeError):
        actor_class.__wrapped_nothing__  # noqa: B018 - dunders are not forwarded


def test_resources_none_or_empty_ask_for_nothing_and_custom_resources_are_taken():
    for value in (None, {}):
        opts = parse_options({"resources": value, "num_cpus": 2}, actor=True)
        assert opts.num_cpus == 2.0 and opts.resources == {}
        assert parse_options({"resources": value, "memory": None}, actor=False).resources == {}
    opts = parse_options({"resources": {"custom": 0.5, "zero": 0}, "memory": 2**30}, actor=True)
    assert opts.resources == {"custom": 0.5, "memory": float(2**30)}
    # node:<address> is node affinity, as in Ray.
    opts = parse_options({"resources": {"node:10.0.0.2": 0.01}}, actor=False)
    assert opts.node == "10.0.0.2" and opts.resources == {}
    for bad in ({"CPU": 1}, {"bad name": 1}, {"x": -1}, {"x": float("inf")}, [("x", 1)],
                {f"r{i}": 1 for i in range(65)}):
        with pytest.raises(InvalidArgumentError):
            parse_options({"resources": bad}, actor=True)
    with pytest.raises(InvalidArgumentError):
        parse_options({"memory": -1}, actor=True)


def test_restart_and_retry_options_are_checked_and_kept():
    opts = parse_options({"max_restarts": -1, "max_task_retries": 3}, actor=True)
    assert (opts.max_restarts, opts.max_task_retries) == (-1, 3)
    task = parse_options({"max_retries": 0, "retry_exceptions": [ValueError, KeyError]}, actor=False)
    assert task.max_retries == 0 and task.retry_exceptions == (ValueError, KeyError)
    # Ray's task default: 3 retries after a worker death, no retry of a raised exception.
    default = parse_options({"max_retries": None}, actor=False)
    assert default.max_retries == 3 and default.retry_exceptions is False
    for bad in ({"max_restarts": -2}, {"max_restarts": 10**9}, {"max_task_retries": 1.5},
                {"max_restarts": True}):
        with pytest.raises(ValueError, match="in \\[-1, "):
            parse_options(bad, actor=True)
    for bad in ("yes", [], [ValueError, "KeyError"], [int]):
        with pytest.raises(ValueError, match="retry_exceptions"):
            parse_options({"retry_exceptions": bad}, actor=False)
    with pytest.raises(ValueError, match="unknown task option 'max_restarts'"):
        parse_options({"max_restarts": 1}, actor=False)
    with pytest.raises(ValueError, match="unknown actor option 'max_retries'"):
        parse_options({"max_retries": 1}, actor=True)


def test_capture_puts_what_a_captured_caller_starts_in_its_group():
    from podium.controller.remote.actoroptions import (CAPTURE_ENV, CURRENT_PG_ENV,
                                                       PlacementGroupSchedulingStrategy, captured)

    inside = {CURRENT_PG_ENV: "pg-1", CAPTURE_ENV: "1"}
    opts = captured(parse_options({}, actor=True), inside)
    assert (opts.placement_group, opts.bundle_index, opts.capture_child_tasks) == ("pg-1", -1, True)
    assert opts.env[CURRENT_PG_ENV] == "pg-1" and opts.env[CAPTURE_ENV] == "1"
    # "DEFAULT" is still captured, as in Ray; an explicit placement is not.
    assert captured(parse_options({"scheduling_strategy": "DEFAULT"}, actor=False), inside).placement_group == "pg-1"
    escaped = captured(parse_options({"scheduling_strategy": PlacementGroupSchedulingStrategy(None)},
                                     actor=True), inside)
    assert escaped.placement_group is None and CURRENT_PG_ENV not in escaped.env
    assert captured(parse_options({"placement_group": "pg-2"}, actor=True), inside).placement_group == "pg-2"
    assert captured(parse_options({"node": "10.0.0.2"}, actor=True), inside).placement_group is None
    # A caller in a group without capture: what it starts is placed as usual.
    assert captured(parse_options({}, actor=True), {CURRENT_PG_ENV: "pg-1"}).placement_group is None
    # The option form and the strategy form both set capture for what the actor starts.
    given = parse_options({"placement_group": "pg-3", "placement_group_capture_child_tasks": True}, actor=True)
    assert captured(given, {}).env == {CURRENT_PG_ENV: "pg-3", CAPTURE_ENV: "1"}
    strategy = PlacementGroupSchedulingStrategy("pg-4", 0, placement_group_capture_child_tasks=True)
    assert captured(parse_options({"scheduling_strategy": strategy}, actor=True), {}).env[CAPTURE_ENV] == "1"


def test_num_returns_is_bounded_and_refused_on_actor_creation():
    from podium.controller.remote.returns import MAX_RETURNS

    assert parse_options({"num_returns": 3}, actor=False).num_returns == 3
    assert parse_options({"num_returns": None}, actor=False).num_returns == 1
    assert parse_options({"num_returns": 1}, actor=True).num_returns == 1
    for bad in (0, -1, MAX_RETURNS + 1, 1.5, True):
        with pytest.raises(InvalidArgumentError):
            parse_options({"num_returns": bad}, actor=False)
    with pytest.raises(NotImplementedError, match="streaming"):
        parse_options({"num_returns": "dynamic"}, actor=False)
    with pytest.raises(InvalidArgumentError, match="actor methods"):
        parse_options({"num_returns": 2}, actor=True)


def test_streaming_options_are_checked_and_bounded():
    from podium.controller.remote.streams import STREAMING, Streaming
    from podium.worker.caller.streaming import DEFAULT_BUFFER, MAX_BUFFER, check_buffer

    assert parse_options({"num_returns": "streaming"}, actor=False).num_returns is STREAMING
    assert parse_options({}, actor=False).num_returns is None  # Ray's default: decided by the function
    given = parse_options({"num_returns": "streaming", "_generator_backpressure_num_objects": 2}, actor=False)
    assert given.backpressure == 2
    assert (check_buffer(None), check_buffer(-1), check_buffer(5)) == (DEFAULT_BUFFER, MAX_BUFFER, 5)
    for bad in (0, -2, MAX_BUFFER + 1, 1.5, True, "2"):
        with pytest.raises(InvalidArgumentError, match="_generator_backpressure_num_objects"):
            parse_options({"_generator_backpressure_num_objects": bad}, actor=False)
        with pytest.raises(InvalidArgumentError):
            Streaming(bad)
    with pytest.raises(InvalidArgumentError, match="actor methods"):
        parse_options({"num_returns": "streaming"}, actor=True)
    with pytest.raises(NotImplementedError, match="one item at a time"):
        parse_options({"_num_objects_per_yield": 2}, actor=False)
    assert parse_options({"_num_objects_per_yield": 1}, actor=False).num_returns is None


def test_what_a_class_declares_its_methods_return():
    from podium.compat.ray import method
    from podium.controller.remote.streams import Streaming, method_returns
    from podium.worker.caller.streaming import STREAMING_RETURNS, declared_returns

    class Declares:
        def one(self):
            return 1

        def gen(self):
            yield 1

        async def agen(self):
            yield 1

        @method(num_returns=2)
        def two(self):
            return 1, 2

        @method(num_returns="streaming", _generator_backpressure_num_objects=3)
        def bounded(self):
            return iter(())

        @method(num_returns=1)
        def gen_as_one(self):
            yield 1

    assert declared_returns(Declares) == {"gen": (STREAMING_RETURNS, None), "agen": (STREAMING_RETURNS, None),
                                          "two": (2, None), "bounded": (STREAMING_RETURNS, 3)}
    assert method_returns(Declares) == {"gen": Streaming(), "agen": Streaming(), "two": 2, "bounded": Streaming(3)}
