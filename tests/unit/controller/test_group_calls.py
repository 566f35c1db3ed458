"""The call object of a WorkerGroup (:class:`GroupCaller`), built alone: a real controller
runtime (its loop thread, no cluster) over in-process ranks that answer through the same
sink protocol as ``WorkerClient.submit_into``."""

from __future__ import annotations

import types

import pytest

from podium.controller.group import GroupCaller, GroupMembers, WorkerHandle
from podium.controller.group.calls import direct_route
from podium.controller.group.views import FUSED_EXECUTE, FUSED_EXECUTE_ASYNC, FusedRoute
from podium.controller.session.runtime import Runtime
from podium.errors import DeadlineExceededError, PodiumError, RemoteError


class LocalRank:
    """One rank answering in process: ``answer(name, payload)`` is its value, or an
    exception it fails with; ``None`` from ``answer`` for a silent rank is not used here."""

    same_host = False
    segments = None
    shm_threshold = 0

    def __init__(self, rank: int, answer):
        self.rank = rank
        self.answer = answer
        self.received: list[tuple[str, object]] = []

    def submit_into(self, name, payload, sink, on_error, *, hold=False, timeout=None, trace=0):
        self.received.append((name, payload))
        try:
            value = self.answer(name, payload)
        except BaseException as exc:  # noqa: BLE001 - the rank's failure, reported through the sink
            on_error(sink, exc)
            return
        sink.set_result(value)


def _info(rank: int, env: dict | None = None):
    spec = types.SimpleNamespace(rank=rank, name=f"w{rank}")
    return types.SimpleNamespace(spec=spec, id=f"id{rank}", node_address="10.0.0.1", port=9000 + rank,
                                 pid=100 + rank, node_id="node", env=env or {})


@pytest.fixture
def rt():
    runtime = Runtime(address="127.0.0.1:1", token="t", call_timeout=5.0)
    yield runtime
    runtime.close()


def _group(rt, answers):
    ranks = [LocalRank(i, answer) for i, answer in enumerate(answers)]
    members = GroupMembers()
    members.connected([WorkerHandle(_info(i, {"MASTER_PORT": "1234"} if i == 0 else None), r)
                       for i, r in enumerate(ranks)])
    return GroupCaller(rt, members, "g"), ranks


def test_a_blocking_call_gathers_every_rank_in_rank_order(rt):
    calls, ranks = _group(rt, [lambda name, p, i=i: (name, i) for i in range(3)])
    per_rank = [((i,), {}) for i in range(3)]
    assert calls.run_all("step", per_rank, blocking=True) == [("step", 0), ("step", 1), ("step", 2)]
    assert calls.run([2], "step", [((), {})], blocking=True) == [("step", 2)]
    assert [len(r.received) for r in ranks] == [1, 1, 2]


def test_ranks_given_the_same_arguments_share_one_encoded_payload(rt):
    calls, ranks = _group(rt, [lambda name, p: None] * 3)
    shared = ((b"x" * 100,), {"k": 1})
    calls.run_all("f", [shared] * 3, blocking=True)
    payloads = [r.received[0][1] for r in ranks]
    assert payloads[0] is payloads[1] is payloads[2]
    calls.run_all("f", [((i,), {}) for i in range(3)], blocking=True)
    distinct = [r.received[1][1] for r in ranks]
    assert distinct[0] is not distinct[1] and distinct[1] is not distinct[2]


def test_the_lowest_failed_rank_explains_the_call_with_its_rank(rt):
    def fails(name, payload):
        raise RemoteError("boom", rank=-1)

    calls, _ = _group(rt, [lambda name, p: 1, fails, fails])
    with pytest.raises(RemoteError) as err:
        calls.run_all("f", [((), {})] * 3, blocking=True)
    assert err.value.rank == 1


def test_a_deadline_names_every_rank_that_did_not_answer(rt):
    def late(name, payload):
        raise DeadlineExceededError("no answer in time")

    calls, _ = _group(rt, [lambda name, p: 1, late, late])
    with pytest.raises(DeadlineExceededError) as err:
        calls.run_all("train", [((), {})] * 3, blocking=True)
    assert err.value.ranks == [1, 2]
    assert "ranks [1, 2] did not answer (1 of 3 did)" in str(err.value)
    assert "train" in str(err.value)


def test_a_non_blocking_call_reports_a_failure_through_its_rank_ref(rt):
    def fails(name, payload):
        raise RemoteError("bad input", rank=-1)

    calls, _ = _group(rt, [fails, fails])
    refs = calls.run_all("f", [((), {})] * 2, blocking=False)
    assert [ref.rank for ref in refs] == [0, 1]
    for rank, ref in enumerate(refs):
        with pytest.raises(RemoteError) as err:
            ref.ref(timeout=10)
        assert err.value.rank == rank


def test_a_closed_caller_refuses_calls_and_a_routed_copy_keeps_its_own_flag(rt):
    calls, _ = _group(rt, [lambda name, p: name])
    view = calls.routed()
    calls.close()
    with pytest.raises(PodiumError, match="WorkerGroup 'g' is shut down"):
        calls.run_all("f", [((), {})], blocking=True)
    assert view.run_all("f", [((), {})], blocking=True) == ["f"]


def test_a_route_decides_what_the_ranks_run(rt):
    calls, ranks = _group(rt, [lambda name, p: name])
    renamed = calls.routed(lambda method, args: ("role_" + method, args))
    assert renamed.run_all("f", [((), {})], blocking=True) == ["role_f"]
    assert calls.run_all("f", [((), {})], blocking=True) == ["f"]
    assert direct_route("m", (1,)) == ("m", (1,))


class _Role:
    def sync_step(self):
        """A role method."""

    async def async_step(self):
        """A coroutine role method."""


class _Fused:
    raw_cls_dict = {"actor": _Role}

    def own(self):
        """A method of the fused class itself."""


def test_a_fused_route_sends_role_methods_through_the_fused_dispatcher():
    route = FusedRoute(_Fused, "actor")
    assert route("sync_step", (1,)) == (FUSED_EXECUTE, ("actor_fwmn_sync_step", 1))
    assert route("async_step", ()) == (FUSED_EXECUTE_ASYNC, ("actor_fwmn_async_step",))
    assert route("own", (2,)) == ("own", (2,))


def test_members_take_the_master_address_from_rank_zero():
    members = GroupMembers()
    members.reserve([WorkerHandle(_info(0), None)])
    assert members.world_size == 0 and len(members.workers) == 1  # created, not connected
    members.connected([WorkerHandle(_info(i), None) for i in range(2)])
    assert (members.world_size, members.names) == (2, ["w0", "w1"])
    assert (members.master_addr, members.master_port) == ("10.0.0.1", None)
    attached = GroupMembers()
    attached.connected([WorkerHandle(_info(0, {"MASTER_PORT": "29500"}), None)], node_is_master=False)
    assert (attached.master_addr, attached.master_port) == (None, "29500")


def _bound(rt, execute_fn, **kwargs):
    """A bound ONE_TO_ALL method over three in-process ranks that answer with their rank."""
    from podium.controller.dispatch import modes as dispatch
    from podium.controller.group import func_generator
    calls, ranks = _group(rt, [lambda name, p, i=i: i for i in range(3)])
    group = types.SimpleNamespace(_calls=calls, world_size=3)
    return func_generator(group, "anything", dispatch.dispatch_one_to_all, dispatch.collect_all_to_all,
                          execute_fn, blocking=True, **kwargs)


def test_rank_zero_comes_from_the_execute_mode_not_a_name(rt):
    from podium.controller.group import WorkerGroup
    from podium.worker import Execute

    def execute_rank_zero(*args):
        """Named like the rank-zero execute function, registered for every rank."""

    assert _bound(rt, execute_rank_zero, execute_mode=Execute.ALL)() == [0, 1, 2]
    assert _bound(rt, execute_rank_zero)() == [0, 1, 2]  # carries no mode: every rank

    def whatever(*args):
        """A name that says nothing."""

    assert _bound(rt, whatever, execute_mode=Execute.RANK_ZERO)() == 0
    # Without an explicit mode, the one the group's execute function carries.
    assert _bound(rt, WorkerGroup.execute_rank_zero)() == 0
    assert _bound(rt, WorkerGroup.execute_all)() == [0, 1, 2]
