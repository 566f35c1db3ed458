"""CallAdmission's rules as tables, with a fake host: which path a call takes, in which order
calls reach the execution thread, and what a CANCEL or a deadline still stops.

Each row of ADMIT is (construct state, gate open, method, payload) -> (path, what the general
path gets); GATES drives the order; START drives the cancel point and the deadline. The rules
these tables pin are described in docs/architecture.md ("One way into the worker host").
"""

from __future__ import annotations

import asyncio
import time

import pytest

from podium import codec, errors
from podium.refs import ObjectRef
from podium.v1 import worker_pb2
from podium.worker.host.activecall import ActiveCall
from podium.worker.host.admission import CallAdmission, Declined
from podium.worker.host.decodeonce import DecodeFailed

REF = ObjectRef("o-1", "w-1", "127.0.0.1:1", 0, 8)


class FakeHeld:
    """The held results: records what a header released."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, ids) -> int:
        self.released.extend(ids)
        return len(ids)


class FakeHost:
    """What admission asks of a host: its construct state, lookup and held results."""

    # name -> (is_async, materialize_futures)
    METHODS = {"sync": (False, True), "aio": (True, True), "raw": (False, False)}

    def __init__(self, state: str) -> None:
        self.construct_state = state
        self.held = FakeHeld()
        self.lookups: list[str] = []

    def lookup(self, name: str):
        self.lookups.append(name)
        if name not in self.METHODS:
            raise errors.UnknownMethodError(f"no method {name!r}")
        is_async, materialize = self.METHODS[name]
        return (lambda *a, **k: (name, a, k)), is_async, materialize


def encoded(value) -> bytes:
    return b"".join(bytes(s) for s in codec.encode(value).to_segments())


def payload(args=(), kwargs=None) -> bytes:
    return encoded((tuple(args), dict(kwargs or {})))


THREAD, GENERAL = "thread", "general"

# (id, construct state, gate open, method, payload) -> (path, what the general path gets:
# "value" the decoded (args, kwargs), "declined" a Declined with the lookup, "failed" a
# DecodeFailed, "none" nothing decoded, or a literal value).
ADMIT = [
    ("sync_in_order_runs_at_once", "done", True, "sync", payload((1,)), THREAD, "value"),
    ("no_arguments_runs_at_once", "done", True, "sync", payload(), THREAD, "value"),
    ("constructor_pending_waits", "pending", True, "sync", payload((1,)), GENERAL, "none"),
    ("no_constructor_yet", "none", True, "sync", payload((1,)), GENERAL, "none"),
    ("constructor_failed", "failed", True, "sync", payload((1,)), GENERAL, "none"),
    ("earlier_call_waits_at_its_gate", "done", False, "sync", payload((1,)), GENERAL, "none"),
    ("async_method_runs_on_the_loop", "done", True, "aio", payload((1,)), GENERAL, "declined"),
    ("ref_argument_is_fetched_first", "done", True, "sync", payload((REF,)), GENERAL, "declined"),
    ("ref_keyword_is_fetched_first", "done", True, "sync", payload((), {"x": REF}), GENERAL, "declined"),
    ("ref_kept_when_not_materialized", "done", True, "raw", payload((REF,)), THREAD, "value"),
    ("unknown_method_is_reported_later", "done", True, "nope", payload((1,)), GENERAL, "value"),
    ("undecodable_payload", "done", True, "sync", b"\x00not a payload", GENERAL, "failed"),
    ("payload_of_none", "done", True, "sync", encoded(None), GENERAL, "failed"),
    ("payload_not_a_pair", "done", True, "sync", encoded(5), GENERAL, 5),
]


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def admission_for(loop, state: str, gate_open: bool = True) -> tuple[CallAdmission, FakeHost]:
    host = FakeHost(state)
    admission = CallAdmission(host, loop)
    if not gate_open:
        admission.reserve_gate()  # an earlier call holds the last gate
    return admission, host


@pytest.mark.parametrize("name, state, gate_open, method, data, path, given", ADMIT, ids=[r[0] for r in ADMIT])
def test_admit_picks_the_path(loop, name, state, gate_open, method, data, path, given):
    admission, host = admission_for(loop, state, gate_open)
    header = worker_pb2.CallHeader(kind=worker_pb2.CALL, method=method, release=["o-gone"])
    fn, x = admission.admit(header, data)
    assert host.held.released == ["o-gone"]  # a header's releases are honoured on every path
    assert (THREAD if fn is not None else GENERAL) == path
    if path == THREAD:
        assert x == codec.decode(data) and fn(*x[0], **x[1])[0] == method
    elif given == "none":
        assert x is None and host.lookups == []  # nothing decoded, nothing looked up
    elif given == "declined":
        assert type(x) is Declined and x.value == codec.decode(data)
        assert x.found[1] == FakeHost.METHODS[method][0]  # the lookup goes along: run_call needs none
    elif given == "failed":
        assert type(x) is DecodeFailed
        with pytest.raises(Exception):
            x.raise_error()
    elif given == "value":
        assert x == codec.decode(data)
    else:
        assert x == given


def test_the_lookup_is_made_once_per_method(loop):
    admission, host = admission_for(loop, "done")
    for _ in range(3):
        for method in ("sync", "aio"):
            admission.admit(worker_pb2.CallHeader(kind=worker_pb2.CALL, method=method), payload((1,)))
    assert host.lookups == ["sync", "aio"]


# Order: calls reserve gates in this order, then open them in the order given; each row says
# which gates are open after each opening. A gate never opens before its predecessor's.
GATES = [
    ("in_order", 3, [0, 1, 2], [{0}, {0, 1}, {0, 1, 2}]),
    ("last_first", 3, [2, 1, 0], [set(), set(), {0, 1, 2}]),
    ("middle_first", 3, [1, 0, 2], [set(), {0, 1}, {0, 1, 2}]),
    ("first_then_last", 3, [0, 2, 1], [{0}, {0}, {0, 1, 2}]),
]


@pytest.mark.parametrize("name, count, opened, expected", GATES, ids=[g[0] for g in GATES])
def test_gates_keep_the_order_of_admission(loop, name, count, opened, expected):
    admission, _ = admission_for(loop, "done")
    gates = [admission.reserve_gate() for _ in range(count)]
    assert not admission.in_order_now()  # a call admitted now would overtake them

    async def drive():
        seen = []
        for index in opened:
            admission.open_gate(*gates[index])
            for _ in range(3):  # let done-callbacks run
                await asyncio.sleep(0)
            seen.append({i for i, (_, mine) in enumerate(gates) if mine.done()})
        return seen

    assert loop.run_until_complete(drive()) == expected
    assert admission.in_order_now()  # all resolved: a call may start at once again


# The cancel point and the deadline, checked just before a general-path call reaches the
# execution thread: (cancelled, deadline relative to now in seconds, None for none) -> error.
START = [
    ("neither", False, None, None),
    ("cancelled_at_its_gate", True, None, errors.CancelledError),
    ("deadline_passed_while_waiting", False, -1.0, errors.DeadlineExceededError),
    ("deadline_still_ahead", False, 3600.0, None),
    ("cancel_wins_over_deadline", True, -1.0, errors.CancelledError),
]


@pytest.mark.parametrize("name, cancelled, deadline, error", START, ids=[s[0] for s in START])
def test_check_start(name, cancelled, deadline, error):
    active = ActiveCall(7, worker_pb2.CallHeader(kind=worker_pb2.CALL, method="sync"), None, None)
    active.cancelled = cancelled
    if deadline is not None:
        active.deadline = time.monotonic() + deadline
    if error is None:
        CallAdmission.check_start(active, "call 'sync'")
    else:
        with pytest.raises(error):
            CallAdmission.check_start(active, "call 'sync'")


def test_deadline_counts_from_admission():
    header = worker_pb2.CallHeader(kind=worker_pb2.CALL, method="sync", timeout_seconds=30)
    before = time.monotonic()
    active = ActiveCall(1, header, None, None)
    assert before + 30 <= active.deadline <= time.monotonic() + 30
    assert ActiveCall(2, worker_pb2.CallHeader(kind=worker_pb2.CALL), None, None).deadline == 0.0
