"""podium.controller.group.colocate: WorkerDict (legacy colocation) and FusedWorker, in-process."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import subprocess
import sys
import textwrap

import cloudpickle
import pytest

from podium.errors import InvalidArgumentError
from podium.controller import (ClassWithInitArgs, create_colocated_worker_cls, create_colocated_worker_cls_fused, create_colocated_worker_raw_cls)
from podium.worker import Dispatch, Execute, Worker, register
from podium.worker.decorator import method_table
from podium.worker.factory import by_value

@pytest.fixture(autouse=True)
def rank_one_of_two(env):
    """Every test here runs as rank 1 of 2 (the shared ``env`` fixture, resized)."""
    env.setenv("WORLD_SIZE", "2")
    return env


class Actor(Worker):
    """verl's test_colocated_workers Actor."""

    def __init__(self) -> None:
        super().__init__()
        self.pid = os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, x):
        return x + self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False, materialize_futures=False)
    def shard(self, data):
        return data

    def unregistered(self):
        return "not bound"


class Critic(Worker):
    """verl's Critic, whose ``sub`` is async."""

    def __init__(self, val) -> None:
        super().__init__()
        self.val = val

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    async def sub(self, x):
        await asyncio.sleep(0)
        return x - self.val

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def peek(self):
        return self.val


class Rollout(Worker):
    @register(dispatch_mode=Dispatch.DIRECT_ROLLOUT_METHOD)
    def generate(self, prompt):
        return f"{prompt}!"


def _roles():
    return {"actor": ClassWithInitArgs(Actor), "critic": ClassWithInitArgs(Critic, val=10)}


# --------------------------------------------------------------------------- WorkerDict


def test_both_roles_are_built_in_one_object():
    cia = create_colocated_worker_cls(_roles())
    assert isinstance(cia, ClassWithInitArgs) and (cia.args, cia.kwargs) == ((), {})
    assert cia.cls.__name__ == "WorkerDict" and issubclass(cia.cls, Worker)
    obj = cia()
    assert set(obj.worker_dict) == {"actor", "critic"}
    assert isinstance(obj.worker_dict["actor"], Actor) and obj.worker_dict["critic"].val == 10
    assert obj.rank == obj.worker_dict["actor"].rank == obj.worker_dict["critic"].rank == 1
    assert obj.worker_dict["actor"].pid == os.getpid()
    assert obj.actor_add(1) == 2
    assert asyncio.run(obj.critic_sub(1)) == -9
    assert obj.critic_peek() == 10
    assert not hasattr(obj, "actor_unregistered")


def test_prefixed_methods_carry_the_roles_registration():
    wd = create_colocated_worker_cls(_roles()).cls
    table = {row["name"]: row for row in method_table(wd)}
    for role, cls in (("actor", Actor), ("critic", Critic)):
        for row in method_table(cls):
            if not row["registered"]:
                assert f"{role}_{row['name']}" not in table
                continue
            outer = table[f"{role}_{row['name']}"]
            assert {**outer, "name": row["name"]} == row
    # Worker built-ins of every role are bound too, as verl does.
    for name in ("actor__query_dispatch_info", "critic__query_collect_info",
                 "actor_execute_with_func_generator", "critic_execute_func_rank_zero"):
        assert table[name]["registered"]
    # ... and the WorkerDict's own.
    assert table["_query_dispatch_info"]["registered"]


def test_async_stays_async_and_sync_stays_sync():
    wd = create_colocated_worker_cls(_roles()).cls
    assert inspect.iscoroutinefunction(wd.critic_sub)
    assert not inspect.iscoroutinefunction(wd.actor_add)
    assert not inspect.iscoroutinefunction(wd.critic_peek)


def test_role_names_and_method_map_are_recorded():
    wd = create_colocated_worker_cls(_roles()).cls
    assert wd.role_names == ("actor", "critic")
    assert wd.role_methods["actor"]["add"] == "actor_add"
    assert wd.role_methods["critic"]["sub"] == "critic_sub"
    assert "unregistered" not in wd.role_methods["actor"]
    assert wd._podium_role_classes == {"actor": Actor, "critic": Critic}


def test_role_mesh_info_stays_per_role():
    obj = create_colocated_worker_cls(_roles())()
    obj.worker_dict["actor"]._register_dispatch_collect_info("actor", 0, True)
    assert obj.actor__query_dispatch_info("actor") == 0
    with pytest.raises(AssertionError):
        obj.critic__query_dispatch_info("actor")


def test_direct_rollout_method_is_bound_unprefixed_for_a_rollout_role():
    wd = create_colocated_worker_cls({"actor_rollout": ClassWithInitArgs(Rollout)}).cls
    assert "generate" in wd.__dict__ and "actor_rollout_generate" not in wd.__dict__
    assert wd.role_methods["actor_rollout"]["generate"] == "generate"
    assert wd().generate("hi") == "hi!"
    other = create_colocated_worker_cls({"critic": ClassWithInitArgs(Rollout)}).cls
    assert "critic_generate" in other.__dict__ and "generate" not in other.__dict__


@pytest.mark.parametrize("class_dict, needle", [
    ({}, "non-empty"),
    ({"actor-1": ClassWithInitArgs(Actor)}, "identifier"),
    ({"a_fwmn_b": ClassWithInitArgs(Actor)}, "_fwmn_"),
    ({"actor": Actor}, "ClassWithInitArgs"),
    ({"actor": ClassWithInitArgs(len)}, "not a class"),
    # two rollout roles both want the unprefixed name
    ({"rollout": ClassWithInitArgs(Rollout), "rollout2": ClassWithInitArgs(Rollout)}, "generate"),
], ids=["empty", "bad-key", "separator", "not-cia", "not-class", "direct-clash"])
def test_bad_colocation_specs_raise(class_dict, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        create_colocated_worker_cls(class_dict)


def test_prefixed_name_clash_raises():
    class Clash(Worker):
        @register()
        def b_c(self):
            return 1

    class Other(Worker):
        @register()
        def c(self):
            return 2

    # "a" + "_b_c" and "a_b" + "_c" both become "a_b_c".
    with pytest.raises(InvalidArgumentError, match="a_b_c"):
        create_colocated_worker_cls({"a": ClassWithInitArgs(Clash), "a_b": ClassWithInitArgs(Other)})


def test_colocated_class_round_trips_through_cloudpickle_in_a_fresh_process(tmp_path):
    cia = create_colocated_worker_cls(_roles())
    with by_value(cia):
        payload = cloudpickle.dumps(cia.construct_payload())
    code = f"""
        import asyncio, importlib.util, json, os, sys
        try:
            found = importlib.util.find_spec({__name__!r})
        except ModuleNotFoundError:  # its package is not importable either
            found = None
        assert found is None, "test module must not be importable"
        os.environ.update(WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
        import cloudpickle
        from podium.worker.decorator import method_table
        cls, args, kwargs = cloudpickle.loads(sys.stdin.buffer.read())
        obj = cls(*args, **kwargs)
        names = [r["name"] for r in method_table(cls) if r["registered"]]
        print(json.dumps([cls.__name__, list(cls.role_names), obj.actor_add(1),
                          asyncio.run(obj.critic_sub(1)), "actor_add" in names,
                          obj.worker_dict["actor"].pid == os.getpid()]))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], input=payload,
                         capture_output=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout) == ["WorkerDict", ["actor", "critic"], 2, -9, True, True]


# --------------------------------------------------------------------------- FusedWorker


FusedBase = create_colocated_worker_raw_cls(_roles())


class HybridWorker(FusedBase):
    """verl's test_fused_workers_on_cpu HybridWorker: a method that uses two roles."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def foo(self, x):
        return self.critic_peek_plus(self.actor.add(x))

    def critic_peek_plus(self, x):
        return x - self.critic.peek()


def test_fused_worker_builds_roles_and_shares_the_dict():
    assert FusedBase.__name__ == "FusedWorker_actor_critic" and FusedBase.is_fused_worker
    assert FusedBase.raw_cls_dict == {"actor": Actor, "critic": Critic}
    assert FusedBase.role_names == ("actor", "critic")
    assert FusedBase.role_methods["critic"]["sub"] == "sub"
    obj = HybridWorker()
    assert obj.actor is obj.fused_worker_dict["actor"] and obj.critic.val == 10
    for role in obj.fused_worker_dict.values():
        assert role.fused_worker_dict is obj.fused_worker_dict
    assert obj.actor.get_fused_worker_by_name("critic") is obj.critic
    assert obj.foo(0.5) == obj._fuw_execute("actor_fwmn_add", 0.5) - 10 == 1.5 - 10


def test_fused_execute_routes_sync_and_async_methods():
    obj = FusedBase()
    assert obj._fuw_execute("actor_fwmn_add", 1) == 2
    assert asyncio.run(obj._fuw_execute_async("critic_fwmn_sub", 1)) == -9
    assert asyncio.run(obj._fuw_execute_async("actor_fwmn_add", 1)) == 2
    # Unlike verl (which fails to pickle a coroutine), a sync route of an async method works.
    assert obj._fuw_execute("critic_fwmn_sub", 1) == -9
    with pytest.raises(AssertionError, match="ref not in fused_worker_dict"):
        obj._fuw_execute("ref_fwmn_add", 1)
    with pytest.raises(InvalidArgumentError, match="_fwmn_"):
        obj._fuw_execute("actor_add", 1)


def test_fused_cls_with_init_args_is_marked():
    cia = create_colocated_worker_cls_fused(_roles())
    assert cia.fused_worker_used is True and cia.cls.is_fused_worker
    assert cia().critic.val == 10


def test_fused_subclass_round_trips_through_cloudpickle_in_a_fresh_process(tmp_path):
    cia = ClassWithInitArgs(HybridWorker)
    cia.fused_worker_used = True
    with by_value(cia):
        payload = cloudpickle.dumps(cia.construct_payload())
    code = f"""
        import asyncio, importlib.util, json, os, sys
        try:
            found = importlib.util.find_spec({__name__!r})
        except ModuleNotFoundError:  # its package is not importable either
            found = None
        assert found is None, "test module must not be importable"
        os.environ.update(WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
        import cloudpickle
        cls, args, kwargs = cloudpickle.loads(sys.stdin.buffer.read())
        obj = cls(*args, **kwargs)
        print(json.dumps([obj.foo(1), asyncio.run(obj._fuw_execute_async("critic_fwmn_sub", 1))]))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], input=payload,
                         capture_output=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout) == [-8, -9]
