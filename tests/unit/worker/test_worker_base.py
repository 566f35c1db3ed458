"""podium.worker.base (Worker, WorkerHelper) and podium.worker.factory (ClassWithInitArgs)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import cloudpickle
import pytest

from podium import codec
from podium.errors import InvalidArgumentError, NotFoundError
from podium.controller import ClassWithInitArgs, RayClassWithInitArgs
from podium.worker import Dispatch, Execute, Worker, register
from podium.worker.base import WorkerHelper
from podium.worker.decorator import get_registration
from podium.worker.factory import by_value, needs_by_value, resolve_class

#: Every variable Worker reads or writes; the fixture restores them all.
# --------------------------------------------------------------------------- Worker env


def test_worker_reads_env_and_writes_it_back(env):
    import os

    w = Worker()
    assert (w.rank, w.world_size) == (1, 4)
    assert w.get_master_addr_port() == ("127.0.0.1", "29500")
    assert (w._local_rank, w._local_world_size) == (0, 1)
    assert os.environ["LOCAL_RANK"] == "0" and os.environ["LOCAL_WORLD_SIZE"] == "1"
    assert os.environ["REDIS_STORE_SERVER_HOST"] == "127.0.0.1"
    assert w.get_cuda_visible_devices() == "not set"
    assert w.fused_worker_dict == {}
    assert Worker.env_keys() == ["WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK",
                                 "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"]


def test_worker_optional_env_and_cuda_override(env):
    import os

    env.setenv("LOCAL_WORLD_SIZE", "2")
    env.setenv("LOCAL_RANK", "1")
    env.setenv("MASTER_ADDR", "[::1]")
    env.setenv("CUDA_VISIBLE_DEVICES", "3")
    w = Worker(cuda_visible_devices="5")
    assert (w._local_rank, w._local_world_size) == (1, 2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5" and w.get_cuda_visible_devices() == "5"
    assert os.environ["REDIS_STORE_SERVER_HOST"] == "::1"


@pytest.mark.parametrize("missing", ["WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_missing_required_env_is_a_keyerror_naming_it(env, missing):
    env.delenv(missing)
    with pytest.raises(KeyError, match=missing):
        Worker()


@pytest.mark.parametrize("given, expected_cuda, error", [
    ({"HIP_VISIBLE_DEVICES": "2"}, "2", None),
    ({"HIP_VISIBLE_DEVICES": "2", "CUDA_VISIBLE_DEVICES": "2"}, "2", None),
    ({"HIP_VISIBLE_DEVICES": "2", "CUDA_VISIBLE_DEVICES": "3"}, None, AssertionError),
    ({"ROCR_VISIBLE_DEVICES": "1"}, "1", None),
    ({"ROCR_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "1"}, None, ValueError),
    ({"ROCR_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "1"}, None, ValueError),
])
def test_amd_visible_devices_fold_into_cuda(env, given, expected_cuda, error):
    import os

    for key, value in given.items():
        env.setenv(key, value)
    if error is not None:
        with pytest.raises(error):
            Worker()
        return
    Worker()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == expected_cuda
    assert "HIP_VISIBLE_DEVICES" not in os.environ and "ROCR_VISIBLE_DEVICES" not in os.environ


# --------------------------------------------------------------------------- mesh info


def test_mesh_registration_and_queries(env):
    w = Worker()
    w._register_dispatch_collect_info("actor", dp_rank=1, is_collect=True)
    w._register_dispatch_collect_info("ref", dp_rank=0, is_collect=False)
    assert w._query_dispatch_info("actor") == 1 and w._query_collect_info("actor") is True
    assert w._query_dispatch_info("ref") == 0 and w.query_collect_info("ref") is False
    assert w.get_dispatch_collect() == {"dispatch_dp_rank": {"actor": 1, "ref": 0},
                                        "collect_dp_rank": {"actor": True, "ref": False}}
    with pytest.raises(ValueError, match="mesh_name actor has been registered"):
        w._register_dispatch_collect_info("actor", dp_rank=0, is_collect=False)
    for query in (w._query_dispatch_info, w._query_collect_info, w.query_collect_info):
        with pytest.raises(AssertionError, match="nope"):
            query("nope")
    for name in ("_query_dispatch_info", "_query_collect_info"):
        reg = get_registration(getattr(Worker, name))
        assert reg["dispatch_mode"] is Dispatch.ONE_TO_ALL and reg["blocking"] is True


def test_set_dispatch_collect_copies_the_last_value(env):
    # verl's test_get_set_dispatch_collect_cpu: re-export an inner engine's mesh.
    inner, outer = Worker(), Worker()
    inner._register_dispatch_collect_info("engine", dp_rank=2, is_collect=True)
    info = inner.get_dispatch_collect()
    outer.set_dispatch_collect("actor", **info)
    assert outer._query_dispatch_info("actor") == 2 and outer._query_collect_info("actor") is True
    outer.set_dispatch_collect("multi", {"a": 0, "b": 3}, {"a": True, "b": False})
    assert outer._query_dispatch_info("multi") == 3 and outer.query_collect_info("multi") is False
    with pytest.raises(AssertionError, match="actor"):
        outer.set_dispatch_collect("actor", **info)
    assert "actor" not in inner.get_dispatch_collect()["dispatch_dp_rank"]


# --------------------------------------------------------------------------- built-ins


def _double_rows(worker, data, factor=2):
    return [x * factor for x in data]


def test_driver_function_builtins(env):
    w = Worker()
    assert w.execute_with_func_generator(_double_rows, [1, 2], factor=3) == [3, 6]
    assert w.execute_func_rank_zero(max, 4, 9) == 9
    reg = get_registration(Worker.execute_with_func_generator)
    assert reg["dispatch_mode"] is Dispatch.DP_COMPUTE_PROTO_WITH_FUNC
    reg = get_registration(Worker.execute_func_rank_zero)
    assert (reg["dispatch_mode"], reg["execute_mode"]) == (Dispatch.ALL_TO_ALL, Execute.RANK_ZERO)


class _NoSuperInit(Worker):
    """verl's test_driverfunc_to_worker ModelActor: never calls Worker.__init__."""

    def __init__(self, scale):
        self.scale = scale

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def scaled(self, x):
        return x * self.scale


def test_subclass_without_super_init_still_works(env):
    w = _NoSuperInit(5)
    assert w.scaled(2) == 10
    assert w.execute_with_func_generator(lambda self, x: self.scale + x, 1) == 6
    w._register_dispatch_collect_info("m", 0, True)
    assert w._query_dispatch_info("m") == 0
    assert w.get_fused_worker_by_name("actor") is None
    assert (w.rank, w.world_size) == (1, 4)  # from the environment
    env.delenv("RANK")
    with pytest.raises(AttributeError, match="RANK"):
        _ = w.rank


def test_fused_worker_lookup(env):
    w, sibling = Worker(), Worker()
    w.fused_worker_dict["critic"] = sibling
    assert w.get_fused_worker_by_name("critic") is sibling
    assert w.get_fused_worker_by_name("actor") is None


# --------------------------------------------------------------------------- WorkerHelper


@pytest.mark.parametrize("setting, expected", [
    ({"WG_BACKEND": "podium", "PODIUM_NODE_ADDRESS": "127.0.0.2"}, "127.0.0.2"),
    ({"WG_BACKEND": "podium", "PODIUM_NODE_ADDRESS": "127.0.0.3:50052"}, "127.0.0.3"),
    ({"WG_BACKEND": "podium", "PODIUM_NODE_ADDRESS": "[::1]:50052"}, "::1"),
    ({"WG_BACKEND": "podium", "PODIUM_NODE_ADDRESS": "127.0.0.2", "MY_HOST_IP": "10.1.2.3"},
     "10.1.2.3"),
])
def test_node_ip(env, setting, expected):
    for key, value in setting.items():
        env.setenv(key, value)
    assert WorkerHelper._get_node_ip() == expected
    assert Worker()._get_node_ip() == expected


def test_available_master_addr_port(env):
    env.setenv("WG_BACKEND", "podium")
    env.setenv("PODIUM_NODE_ADDRESS", "[::1]")
    env.setattr(WorkerHelper, "_get_free_port", staticmethod(lambda: 40123))
    assert WorkerHelper.get_available_master_addr_port() == ("::1", "40123")
    assert Worker().get_availale_master_addr_port() == ("::1", "40123")


def test_importing_podium_worker_stays_light():
    code = ("import sys, podium.worker\n"
            "heavy = [m for m in ('torch', 'grpc', 'numpy', 'tensordict') if m in sys.modules]\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- ClassWithInitArgs


class _Scorer(Worker):
    def __init__(self, base, *, bonus=0):
        super().__init__()
        self.base = base
        self.bonus = bonus

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def score(self, x):
        return self.base + self.bonus + x + self.rank


class _FakeRayRemote:
    """What ``@ray.remote`` leaves behind: the plain class under ``__ray_actor_class__``."""

    __ray_actor_class__ = _Scorer


def test_class_with_init_args_defers_construction(env):
    cia = ClassWithInitArgs(_Scorer, 10, bonus=5)
    assert (cia.cls, cia.args, cia.kwargs, cia.fused_worker_used) == (_Scorer, (10,), {"bonus": 5}, False)
    assert RayClassWithInitArgs is ClassWithInitArgs
    obj = cia()
    assert isinstance(obj, _Scorer) and obj.score(1) == 17
    assert cia.construct_payload() == (_Scorer, (10,), {"bonus": 5})
    cia.update_options({"name": "x"})
    cia.update_options({"lifetime": "detached"})
    cia.set_additional_resource({"custom": 1})
    assert cia._options == {"name": "x", "lifetime": "detached"}
    assert cia._additional_resource == {"custom": 1}
    ray_style = ClassWithInitArgs(_FakeRayRemote, 1)
    assert ray_style.construct_payload()[0] is _Scorer and isinstance(ray_style(), _Scorer)


def _run_child(code, payload, cwd):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], input=payload,
                          capture_output=True, timeout=60, cwd=cwd)


def test_by_value_for_a_class_of_the_test_module(env, tmp_path):
    cia = ClassWithInitArgs(_Scorer, 10, bonus=5)
    with cia.by_value():
        payload = b"".join(codec.encode(cia.construct_payload()).to_segments())
    code = f"""
        import importlib.util, json, os, sys
        try:
            found = importlib.util.find_spec({__name__!r})
        except ModuleNotFoundError:  # its package is not importable either
            found = None
        assert found is None, "test module must not be importable"
        os.environ.update(WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
        from podium import codec
        cls, args, kwargs = codec.decode(sys.stdin.buffer.read())
        print(json.dumps([cls.__name__, cls(*args, **kwargs).score(1)]))
    """
    out = _run_child(code, payload, tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout) == ["_Scorer", 17]


HELPER_MODULE = '''
from podium.worker import Worker, register, Dispatch


class Greeter(Worker):
    def __init__(self, greeting):
        self.greeting = greeting

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def greet(self, name):
        return f"{self.greeting}, {name}"
'''


@pytest.fixture
def helper_module(tmp_path, monkeypatch):
    """A module beside the 'script', importable here only (not installed, not a test file)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "wapi_local_workers.py").write_text(HELPER_MODULE)
    monkeypatch.syspath_prepend(str(src))
    import wapi_local_workers

    yield wapi_local_workers
    monkeypatch.delitem(sys.modules, "wapi_local_workers")


def test_by_value_ships_a_local_module_class_and_then_unregisters(helper_module, tmp_path):
    child = """
        import sys, cloudpickle
        cls, args, kwargs = cloudpickle.loads(sys.stdin.buffer.read())
        print(cls(*args, **kwargs).greet("podium"))
    """
    cia = ClassWithInitArgs(helper_module.Greeter, "hello")
    assert needs_by_value("wapi_local_workers")
    by_reference = cloudpickle.dumps(cia.construct_payload())
    failed = _run_child(child, by_reference, tmp_path)
    assert failed.returncode != 0 and b"wapi_local_workers" in failed.stderr
    with by_value(cia):
        with by_value(helper_module.Greeter):  # nesting keeps it registered
            pass
        assert "wapi_local_workers" in cloudpickle.list_registry_pickle_by_value()
        shipped = cloudpickle.dumps(cia.construct_payload())
    assert "wapi_local_workers" not in cloudpickle.list_registry_pickle_by_value()
    out = _run_child(child, shipped, tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().strip() == "hello, podium"


@pytest.mark.parametrize("module_name, expected", [
    ("__main__", False),          # cloudpickle ships __main__ by value on its own
    ("json", False),              # standard library
    ("cloudpickle", False),       # site-packages
    ("podium.worker.base", False),
    ("not_imported_anywhere", False),
    (None, False),
])
def test_needs_by_value(module_name, expected):
    assert needs_by_value(module_name) is expected


@pytest.mark.parametrize("ref", [Worker, "podium.worker.base:Worker", "podium.worker.base.Worker",
                                 "podium.worker:Worker"])
def test_resolve_class(ref):
    assert resolve_class(ref) is Worker


@pytest.mark.parametrize("ref, error", [
    ("podium.nonexistent_module:Worker", NotFoundError),
    ("podium.worker.base:NoSuchClass", NotFoundError),
    ("podium.worker.base:WorkerHelper._get_node_ip", InvalidArgumentError),
    ("Worker", InvalidArgumentError),
    ("", InvalidArgumentError),
    (42, InvalidArgumentError),
])
def test_resolve_class_errors(ref, error):
    with pytest.raises(error):
        resolve_class(ref)
