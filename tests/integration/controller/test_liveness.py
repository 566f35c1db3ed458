"""Issue #14, item 1: a hung rank (SIGSTOP) fails the pending call after a bounded silence
with an error naming rank, node, pid and how long it was silent, and carrying what could be
had of its stacks (issue #32: its /proc state); a long method in a live
process is never cut short; ``with call_timeout(s):`` bounds the calls of a block."""

from __future__ import annotations

import os
import signal
import time

import pytest

import podium
from podium import call_timeout, errors
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.controller.session.runtime import get_runtime
from podium.worker import Dispatch, Worker, register
from tests.support.clusters import controller_cluster

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

#: The liveness bound these tests run with (the default is 10 s).
SILENCE = 2.0


class Busy(Worker):
    """Naps, or spins holding the GIL in pure Python."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nap(self, seconds):
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def spin(self, seconds):
        end, n = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            n += 1
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def nap_later(self, seconds):
        time.sleep(seconds)
        return self.rank


@pytest.fixture(scope="module", autouse=True)
def cluster(tmp_path_factory):
    with controller_cluster("embedded", tmp_path_factory.mktemp("embedded")):
        liveness = get_runtime().deathwatch.liveness
        old, liveness.silence = liveness.silence, SILENCE
        try:
            yield
        finally:
            liveness.silence = old


@pytest.fixture
def group():
    wg = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Busy))
    try:
        yield wg
    finally:
        wg.shutdown()


def test_a_stopped_rank_fails_the_call_naming_rank_node_pid_and_silence(group):
    pids = group.pid()
    os.kill(pids[1], signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(errors.UnresponsiveError) as info:
            group.nap(120)
        print(f"\nSIGSTOPped rank found {time.monotonic() - started:.1f} s after the call "
              f"(liveness bound {SILENCE:g} s)")
    finally:
        os.kill(pids[1], signal.SIGCONT)
    err = info.value
    assert err.ranks == [1] and err.rank == 1
    assert isinstance(err, errors.DeadlineExceededError)
    text = str(err)
    assert f"pid {pids[1]}" in text and "silent for" in text and err.node in text and err.node
    # The last stacks that could be had: a stopped rank cannot answer, so its /proc state.
    assert list(err.stacks) == [1]
    assert "T (stopped)" in err.stacks[1] and f"pid {pids[1]}" in err.stacks[1]
    assert "no stacks:" in err.stacks[1] and "SIGCONT" in err.stacks[1]
    assert "last stacks" in text and "T (stopped)" in text
    assert errors.UnresponsiveError("x", details={"stacks.3": "s", "stacks.x": "-"}).stacks == {3: "s"}


def test_a_long_method_in_a_live_process_is_never_cut_short(group):
    # Longer than the liveness bound: pure-Python spinning (the GIL held), then sleeping.
    assert group.spin(1.5 * SILENCE) == [0, 1]
    assert group.nap(1.5 * SILENCE) == [0, 1]
    assert get_runtime().deathwatch.liveness.found == 1  # only the SIGSTOP test's rank


def test_call_timeout_bounds_the_calls_and_gets_of_a_block(group):
    with call_timeout(0.5):
        with pytest.raises(errors.DeadlineExceededError) as info:
            group.nap(2)
        assert not isinstance(info.value, errors.UnresponsiveError)
        refs = group.nap_later(2)
        with pytest.raises(errors.DeadlineExceededError):
            podium.get(refs)
    with call_timeout(60):
        with call_timeout(30):
            assert group.nap(0) == [0, 1]


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), 1e12, "10"])
def test_call_timeout_refuses_bad_durations(bad):
    with pytest.raises(errors.InvalidArgumentError):
        with call_timeout(bad):
            pass
