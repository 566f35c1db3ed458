"""podium.worker.decorator: DynamicEnum, Dispatch/Execute, @register, method_table.

Mirrors verl's tests/single_controller/base/test_decorator.py for the enum part
(register_dispatch_mode itself lives in podium.controller.dispatch.modes).
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import subprocess
import sys

import cloudpickle
import pytest

from podium.errors import InvalidArgumentError
from podium.refs import DataProtoFuture, ObjectRef, set_resolver
from podium.worker.decorator import MAGIC_ATTR
from podium.worker import Dispatch, DynamicEnum, Execute, Worker, register
from podium.worker.decorator import PODIUM_ATTR, get_registration, method_table

VERL_DISPATCH_ORDER = ["RANK_ZERO", "ONE_TO_ALL", "ALL_TO_ALL", "DP_COMPUTE", "DP_COMPUTE_PROTO",
                       "DP_COMPUTE_PROTO_WITH_FUNC", "DP_COMPUTE_METRIC", "DIRECT_ROLLOUT_METHOD"]


# --------------------------------------------------------------------------- DynamicEnum


def test_predefined_members_in_verl_order():
    assert Dispatch.names() == VERL_DISPATCH_ORDER
    assert [m.value for m in Dispatch] == list(range(8))
    assert Execute.names() == ["ALL", "RANK_ZERO"]
    assert [m.value for m in Execute] == [0, 1]
    assert Dispatch.RANK_ZERO is not Execute.RANK_ZERO
    assert repr(Dispatch.DP_COMPUTE_PROTO) == "<Dispatch.DP_COMPUTE_PROTO: 4>"


def test_register_new_dispatch_mode_and_remove():
    # verl's test_register_new_dispatch_mode, enum half. Other tests may have registered
    # (and removed) modes before this one runs: the new value follows every value in use.
    values_before = {m.value for m in Dispatch.values()}
    member = Dispatch.register("test_mode")
    try:
        assert member.name == "TEST_MODE" and member.value >= 8
        assert member.value not in values_before and member.value > max(values_before, default=-1)
        assert Dispatch.TEST_MODE is member
        assert Dispatch.from_name("test_mode") is member
        assert Dispatch["TEST_MODE"] is member
        assert "TEST_MODE" in Dispatch and member in Dispatch
        assert Dispatch.names()[-1] == "TEST_MODE"
        assert pickle.loads(pickle.dumps(member)) is member
        with pytest.raises(ValueError, match="TEST_MODE already registered"):
            Dispatch.register("TEST_MODE")
    finally:
        assert Dispatch.remove("TEST_MODE") is member
    assert "TEST_MODE" not in Dispatch and member not in Dispatch
    assert not hasattr(Dispatch, "TEST_MODE")
    assert Dispatch.from_name("TEST_MODE") is None
    assert Dispatch.names() == VERL_DISPATCH_ORDER


def test_subclass_has_its_own_registry():
    class Color(DynamicEnum):
        pass

    red = Color.register("red")
    blue = Color.register("Blue")
    assert Color.values() == [red, blue] and list(Color) == [red, blue]
    assert (red.value, blue.value) == (0, 1)
    assert Color.names() == ["RED", "BLUE"]
    assert "RED" not in Dispatch and len(Color) == 2
    with pytest.raises(KeyError):
        Color.remove("green")
    assert red not in Dispatch and Dispatch.ONE_TO_ALL not in Color


@pytest.mark.parametrize("member", [*Dispatch.values(), *Execute.values()], ids=repr)
def test_members_pickle_by_name(member):
    for dumps in (pickle.dumps, cloudpickle.dumps):
        assert pickle.loads(dumps(member)) is member
    assert member.name.encode() in pickle.dumps(member)


def test_members_unpickle_to_the_receivers_member_in_a_fresh_process():
    payload = pickle.dumps([Dispatch.DP_COMPUTE_PROTO, Execute.RANK_ZERO])
    code = ("import pickle, sys\n"
            "from podium.worker import Dispatch, Execute\n"
            "d, e = pickle.loads(sys.stdin.buffer.read())\n"
            "assert d is Dispatch.DP_COMPUTE_PROTO and e is Execute.RANK_ZERO\n"
            "print(d.name, e.name)\n")
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True,
                         timeout=60, check=True)
    assert out.stdout.split() == [b"DP_COMPUTE_PROTO", b"RANK_ZERO"]


def test_a_custom_member_unknown_to_the_receiver_is_added_there():
    # verl raises AttributeError here (sharp edge 23); the worker needs only the name.
    member = Dispatch.register("controller_only_mode")
    try:
        payload = pickle.dumps(member)
    finally:
        Dispatch.remove("controller_only_mode")
    code = ("import pickle, sys\n"
            "from podium.worker import Dispatch\n"
            "m = pickle.loads(sys.stdin.buffer.read())\n"
            "assert m is Dispatch.CONTROLLER_ONLY_MODE is Dispatch.from_name('controller_only_mode')\n"
            "print(m.name)\n")
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == b"CONTROLLER_ONLY_MODE"


# --------------------------------------------------------------------------- register


def _custom_dispatch():
    return {"dispatch_fn": lambda wg, *a, **kw: (a, kw), "collect_fn": lambda wg, out: out}


@pytest.mark.parametrize("kwargs, needle", [
    ({"dispatch_mode": "ONE_TO_ALL"}, "'ONE_TO_ALL'"),
    ({"dispatch_mode": None}, "None"),
    ({"dispatch_mode": Execute.ALL}, "<Execute.ALL: 0>"),
    ({"dispatch_mode": {"dispatch_fn": print}}, "'collect_fn'"),
    ({"dispatch_mode": {"collect_fn": print}}, "'dispatch_fn'"),
    ({"execute_mode": Dispatch.ALL_TO_ALL}, "<Dispatch.ALL_TO_ALL: 2>"),
    ({"execute_mode": "ALL"}, "'ALL'"),
], ids=lambda v: repr(v)[:40])
def test_register_rejects_bad_modes_at_decoration_time(kwargs, needle):
    with pytest.raises(InvalidArgumentError) as info:
        register(**kwargs)
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_register_stores_verls_attrs_and_podiums_flag():
    custom = _custom_dispatch()

    class W:
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def a(self, x):
            """Doc of a."""
            return x

        @register(dispatch_mode=custom, execute_mode=Execute.RANK_ZERO, blocking=False,
                  materialize_futures=False)
        def b(self, x):
            return x

    attrs = getattr(W.a, MAGIC_ATTR)
    assert attrs == {"dispatch_mode": Dispatch.DP_COMPUTE_PROTO, "execute_mode": Execute.ALL,
                     "blocking": True}
    assert getattr(W.a, PODIUM_ATTR) == {"materialize_futures": True}
    assert W.a.__name__ == "a" and W.a.__doc__ == "Doc of a."
    assert get_registration(W.b) == {"dispatch_mode": custom, "execute_mode": Execute.RANK_ZERO,
                                     "blocking": False, "materialize_futures": False}
    assert get_registration(W().b)["dispatch_mode"] is custom  # bound methods too
    assert get_registration(lambda: None) is None


def test_get_registration_of_a_verl_style_function_defaults_materialize_on():
    def f():
        pass

    setattr(f, MAGIC_ATTR, {"dispatch_mode": Dispatch.ONE_TO_ALL, "execute_mode": Execute.ALL,
                            "blocking": True})
    assert get_registration(f)["materialize_futures"] is True


def test_registered_methods_behave_like_plain_methods_locally():
    class W:
        def __init__(self):
            self.base = 10

        @register()
        def add(self, x, *, y=0):
            return self.base + x + y

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        async def aadd(self, x, *, y=0):
            await asyncio.sleep(0)
            return self.base + x + y

    w = W()
    assert w.add(1, y=2) == 13
    assert not inspect.iscoroutinefunction(W.add)
    assert inspect.iscoroutinefunction(W.aadd) and inspect.iscoroutinefunction(w.aadd)
    assert asyncio.run(w.aadd(1, y=3)) == 14


# --------------------------------------------------------------------------- futures


class _DictResolver:
    """Resolves refs from a dict by object id (stands in for the worker pool of clients)."""

    def __init__(self, values):
        self.values = values
        self.fetched = []

    async def fetch(self, ref, rows=None):
        self.fetched.append(ref.object_id)
        return self.values[ref.object_id]

    def run_sync(self, coro, timeout):
        return asyncio.run(coro)


def _future(object_id):
    return DataProtoFuture([ObjectRef(object_id, "w-0", "127.0.0.1:1", 0, 1)])


@pytest.fixture
def resolver():
    res = _DictResolver({"o-a": "A", "o-b": "B", "o-c": "C"})
    previous = set_resolver(res)
    try:
        yield res
    finally:
        set_resolver(previous)


class _FutureTaker:
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def sync_on(self, a, nested, *, k):
        return a, nested, k

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    async def async_on(self, a, nested, *, k):
        return a, nested, k

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, materialize_futures=False)
    def sync_off(self, a, nested, *, k):
        return a, nested, k

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, materialize_futures=False)
    async def async_off(self, a, nested, *, k):
        return a, nested, k


@pytest.mark.parametrize("method, is_async, materialized", [
    ("sync_on", False, True), ("async_on", True, True),
    ("sync_off", False, False), ("async_off", True, False),
])
def test_top_level_futures_are_materialized_in_the_worker(resolver, method, is_async, materialized):
    a, nested, k = _future("o-a"), [_future("o-b")], _future("o-c")
    call = getattr(_FutureTaker(), method)(a, nested, k=k)
    got_a, got_nested, got_k = asyncio.run(call) if is_async else call
    if materialized:
        assert (got_a, got_k) == ("A", "C")
        assert sorted(resolver.fetched) == ["o-a", "o-c"]
    else:
        assert (got_a, got_k) == (a, k) and resolver.fetched == []
    assert got_nested[0] is nested[0]  # nested futures are left alone, as in verl


def test_arguments_without_futures_pass_through_untouched(resolver):
    payload = object()
    assert _FutureTaker().sync_on(payload, [], k=3) == (payload, [], 3)
    assert asyncio.run(_FutureTaker().async_on(payload, [], k=3)) == (payload, [], 3)


# --------------------------------------------------------------------------- method_table


_CUSTOM = _custom_dispatch()


class _Described(Worker):
    value = 3  # data attribute: not callable, skipped

    @property
    def broken(self):
        raise RuntimeError("a property that fails is skipped")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def compute(self, data):
        return data

    @register(dispatch_mode=_CUSTOM, execute_mode=Execute.RANK_ZERO, materialize_futures=False)
    async def custom(self, data):
        return data

    def plain(self):
        return "plain"

    async def aplain(self):
        return "aplain"

    def _private(self):
        return "hidden"


def test_method_table_is_alphabetical_and_complete():
    rows = method_table(_Described)
    names = [r["name"] for r in rows]
    assert names == sorted(names)
    assert names == [
        "_query_collect_info", "_query_dispatch_info", "aplain", "compute", "custom", "env_keys",
        "execute_func_rank_zero", "execute_with_func_generator", "get_available_master_addr_port",
        "get_availale_master_addr_port", "get_cuda_visible_devices", "get_dispatch_collect",
        "get_fused_worker_by_name", "get_master_addr_port", "plain", "query_collect_info",
        "set_dispatch_collect"]
    # An instance (whose failing property raises on getattr) lists the same methods.
    assert [r["name"] for r in method_table(_Described.__new__(_Described))] == names


@pytest.mark.parametrize("name, expected", [
    ("compute", {"dispatch_mode": "DP_COMPUTE_PROTO", "dispatch": Dispatch.DP_COMPUTE_PROTO,
                 "execute_mode": "ALL", "blocking": False, "materialize_futures": True,
                 "is_async": False, "registered": True}),
    ("custom", {"dispatch_mode": "CUSTOM", "dispatch": _CUSTOM, "execute_mode": "RANK_ZERO",
                "blocking": True, "materialize_futures": False, "is_async": True,
                "registered": True}),
    ("_query_dispatch_info", {"dispatch_mode": "ONE_TO_ALL", "dispatch": Dispatch.ONE_TO_ALL,
                              "execute_mode": "ALL", "blocking": True,
                              "materialize_futures": True, "is_async": False, "registered": True}),
    ("execute_func_rank_zero", {"dispatch_mode": "ALL_TO_ALL", "dispatch": Dispatch.ALL_TO_ALL,
                                "execute_mode": "RANK_ZERO", "blocking": True,
                                "materialize_futures": True, "is_async": False,
                                "registered": True}),
    ("plain", {"dispatch_mode": "", "dispatch": None, "execute_mode": "", "blocking": True,
               "materialize_futures": False, "is_async": False, "registered": False}),
    ("aplain", {"dispatch_mode": "", "dispatch": None, "execute_mode": "", "blocking": True,
                "materialize_futures": False, "is_async": True, "registered": False}),
])
def test_method_table_rows(name, expected):
    rows = {r["name"]: r for r in method_table(_Described)}
    assert rows[name] == {"name": name, **expected}


def test_custom_dispatch_row_cloudpickles():
    row = next(r for r in method_table(_Described) if r["name"] == "custom")
    restored = cloudpickle.loads(cloudpickle.dumps(row["dispatch"]))
    assert set(restored) == {"dispatch_fn", "collect_fn"}
    assert restored["collect_fn"](None, [1]) == [1]
