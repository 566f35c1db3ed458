"""Disaggregated rollout replicas: two RolloutServer actors (real worker processes, each a
real in-process vLLM engine on CPU) behind a RolloutServerManager: requests balanced by
load and served concurrently, weight updates down the broadcast chain into vLLM with the
"drain" and "abort" policies, and bad input. Skipped, naming vLLM, where it is not installed.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from podium.rollout.broadcast import WeightSender
from podium.rollout.server import RolloutServer
from podium.worker import Dispatch, Worker, register
from podium.worker.decorator import Execute
from tests.support.rollout_kit import forcing_state_dict, original_state_dict, vllm_marks

pytestmark = [*vllm_marks, pytest.mark.timeout(300)]

FORCED = 9            # a plain word's id
MAX_TOKENS = 96       # long responses: requests stay in flight while an update starts
WAIT_S = 120          # the longest any poll of this module waits
PROMPT = [1, 4, 5, 6]


class Holder(Worker):
    """A trainer stand-in: holds a state dict the test sets, sends it down the chain."""

    def __init__(self) -> None:
        super().__init__()
        self.state: dict = {}
        self.gate: tuple[str, str] | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_state(self, state: dict, gate: tuple[str, str] | None = None) -> None:
        """The weights the next broadcast sends; with ``gate`` (two paths), it writes the
        first and waits for the second before the last tensor."""
        self.state, self.gate = state, gate

    def _pairs(self):
        items = list(self.state.items())
        for i, pair in enumerate(items):
            if self.gate and i == len(items) - 1:
                waiting, gate = self.gate
                open(waiting, "w").close()
                deadline = time.monotonic() + WAIT_S
                while not os.path.exists(gate) and time.monotonic() < deadline:
                    time.sleep(0.01)
            yield pair

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def broadcast_send(self, head: dict, step: int | None = None, bucket_bytes: int = 1 << 20,
                       timeout: float = 60.0) -> dict:
        """Send the held weights to the chain's head (small buckets: several go out before the gate)."""
        return WeightSender(4 << 10, timeout).send(self._pairs(), head, step)


class SteppedServer(RolloutServer):
    """A replica whose engine can be told to step only once a file exists: the test then
    knows requests are still in flight when an update starts, without racing them."""

    def hold_steps(self, gate: str) -> None:
        """From now on each engine step first waits (at most WAIT_S) for ``gate`` to exist."""
        engine = self.engine.llm.llm_engine
        step = type(engine).step

        def held_step():
            deadline = time.monotonic() + WAIT_S
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.01)
            return step(engine)

        engine.step = held_step

    def free_steps(self) -> None:
        """Step as vLLM does again."""
        self.engine.llm.llm_engine.__dict__.pop("step", None)


def _config(model_dir):
    return dict(model_path=model_dir, n=4, max_tokens=MAX_TOKENS, max_model_len=128, ignore_eos=True,
                kv_cache_memory_bytes=16 << 20, seed=5)


@pytest.fixture(scope="module")
def manager(cluster, model_dir):
    from podium.rollout.servermanager import RolloutServerManager

    # Without replacement: these tests count on the rotation they set up (test_rollout_replacement.py
    # covers replicas that come back).
    mgr = RolloutServerManager.launch(_config(model_dir), replicas=2, max_requests=3, name_prefix="srv",
                                      server_cls=SteppedServer, replace=False)
    yield mgr
    mgr.shutdown()


@pytest.fixture(scope="module")
def holder(cluster):
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup

    wg = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Holder),
                     name_prefix="holder")
    yield wg
    wg.shutdown()


def _poll(what, check):
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def _in_engines(manager, count):
    _poll(f"{count} requests in the engines", lambda: sum(s["in_flight"] for s in manager.stats()) >= count)


def test_requests_balanced_by_load_and_served_concurrently(manager):
    import podium

    before = {s["replica"]: s["served"] for s in manager.stats()}
    # Close both replicas' gates (as an update would) so requests pile up there: the
    # manager's per-replica load is then exactly what it dispatched.
    podium.get([r.begin_update.remote("drain") for r in manager.replicas])
    futures = [manager.submit(PROMPT, n=1, width=6, index=i) for i in range(6)]
    _poll("6 requests held at the replicas", lambda: sum(s["held"] for s in manager.stats()) == 6)
    assert manager.load() == [3, 3]
    assert [s["held"] for s in manager.stats()] == [3, 3]
    # A 7th waits in the manager: both replicas are at max_requests.
    seventh = manager.submit(PROMPT, n=1, width=6, index=6)
    time.sleep(0.2)
    assert not seventh.done() and manager.load() == [3, 3]
    podium.get([r.end_update.remote() for r in manager.replicas])
    results = [f.result(WAIT_S) for f in [*futures, seventh]]
    assert [int(r.batch["index"][0]) for r in results] == list(range(7))
    assert all(tuple(r.batch["responses"].shape) == (1, MAX_TOKENS) for r in results)
    after = {s["replica"]: s["served"] for s in manager.stats()}
    served = sorted(after[name] - before[name] for name in manager.names)
    assert served == [3, 4]
    assert manager.load() == [0, 0]


@pytest.fixture
def held_steps(manager, tmp_path):
    """Both replicas' engines wait at their next step until the test calls the fixture's
    value (which opens the gate); steps run freely again after the test."""
    import podium

    gate = str(tmp_path / "steps")
    podium.get([r.hold_steps.remote(gate) for r in manager.replicas])
    yield lambda: open(gate, "w").close()
    open(gate, "w").close()
    podium.get([r.free_steps.remote() for r in manager.replicas])


def _update_while_held(manager, release, **update_args):
    """Run ``manager.update_weights`` in a thread; once both replicas closed their gates
    (the requests in flight are counted then), let the engines step; the update's result."""
    outcome: list = []

    def update():
        try:
            outcome.append(manager.update_weights(**update_args))
        except Exception as exc:  # noqa: BLE001 - the test reraises it
            outcome.append(exc)

    thread = threading.Thread(target=update)
    thread.start()
    _poll("both replicas updating", lambda: all(s["updating"] for s in manager.stats()))
    release()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def test_drain_lets_requests_finish_on_the_old_weights(manager, holder, model_dir, held_steps):
    version = manager.version
    holder.set_state(forcing_state_dict(model_dir, FORCED))
    futures = [manager.submit(PROMPT, n=4, width=6) for _ in range(2)]  # one per replica
    _in_engines(manager, 2)
    update = _update_while_held(manager, held_steps, source=holder, version=version + 1, policy="drain",
                                timeout=60)
    assert update["aborted"] == 0 and update["drained"] == 2 and update["replicas"] == 2
    old = [f.result(WAIT_S) for f in futures]
    # Every request sent before the update ran on the old policy, start to end.
    assert all(set(r.batch["policy_version"].tolist()) == {version} for r in old)
    assert not all((r.batch["responses"] == FORCED).all() for r in old)
    # Afterwards both replicas generate with the forcing weights.
    new = [manager.generate(PROMPT, n=2, width=6) for _ in range(4)]
    for r in new:
        assert set(r.batch["policy_version"].tolist()) == {version + 1}
        assert (r.batch["responses"] == FORCED).all()
        assert r.batch["old_log_probs"].abs().max().item() < 1e-4
    assert {s["version"] for s in manager.stats()} == {version + 1}


def test_abort_fails_requests_in_flight_with_a_typed_error(manager, holder, model_dir, held_steps):
    from podium.errors import AbortedError

    version = manager.version
    holder.set_state(original_state_dict(model_dir))
    futures = [manager.submit(PROMPT, n=4, width=6, request_id=f"ab-{i}") for i in range(2)]
    _in_engines(manager, 2)
    update = _update_while_held(manager, held_steps, source=holder, version=version + 1, policy="abort",
                                timeout=60)
    assert update["aborted"] == 2 and update["drained"] == 0
    for i, f in enumerate(futures):
        with pytest.raises(AbortedError) as info:
            f.result(WAIT_S)
        assert info.value.details["request_id"] == f"ab-{i}" and info.value.details["replica"] in manager.names
        assert f"ab-{i}" in str(info.value) and info.value.details["replica"] in str(info.value)
    r = manager.generate(PROMPT, n=4, width=6)
    assert set(r.batch["policy_version"].tolist()) == {version + 1}
    assert not (r.batch["responses"] == FORCED).all()  # the original weights are back
    assert manager.load() == [0, 0]


def test_bad_input_is_a_typed_error_and_the_pool_keeps_serving(manager, holder):
    from podium.errors import InvalidArgumentError
    from podium.rollout.servermanager import RolloutServerManager

    with pytest.raises(InvalidArgumentError, match="policy"):
        manager.update_weights(holder, version=manager.version + 1, policy="later")
    with pytest.raises(InvalidArgumentError, match="version"):
        manager.update_weights(holder, version=manager.version, policy="drain")
    with pytest.raises(InvalidArgumentError, match="timeout"):
        manager.generate(PROMPT, timeout=-1)
    with pytest.raises(InvalidArgumentError, match="n must be"):
        manager.generate(PROMPT, n=10**6)
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        manager.generate([1] * 100)
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        manager.generate([1, 10_000])
    with pytest.raises(InvalidArgumentError, match="replicas"):
        RolloutServerManager.launch({}, replicas=0)
    with pytest.raises(InvalidArgumentError, match="server_cls"):
        RolloutServerManager.launch({}, server_cls=Holder)
    assert len(manager.generate(PROMPT, n=2, width=6)) == 2
    assert manager.load() == [0, 0]


def test_a_dead_replica_leaves_the_rotation_and_the_update_goes_on(manager, holder, model_dir):
    # Last in this module: it kills a replica of the shared pool.
    victim_name, victim_pid = manager.names[1], manager.stats()[1]["pid"]
    os.kill(victim_pid, signal.SIGKILL)
    holder.set_state(forcing_state_dict(model_dir, FORCED))
    version = manager.version
    update = manager.update_weights(holder, version=version + 1, policy="drain", timeout=60)
    assert update["dropped"] == [victim_name] and update["replicas"] == 1
    assert victim_name in manager.dropped and "died" in manager.dropped[victim_name]
    assert manager.serving() == [manager.names[0]]
    for _ in range(4):  # every request now goes to the survivor, on the new weights
        r = manager.generate(PROMPT, n=2, width=6)
        assert set(r.batch["policy_version"].tolist()) == {version + 1}
        assert (r.batch["responses"] == FORCED).all()
    assert manager.load() == [0, 0]


def test_a_replica_dying_mid_broadcast_is_dropped_and_the_one_behind_it_gets_the_update_again(
        cluster, holder, model_dir, tmp_path):
    from podium.rollout.servermanager import RolloutServerManager

    mgr = RolloutServerManager.launch(_config(model_dir), replicas=3, max_requests=2, name_prefix="chain",
                                      replace=False)
    try:
        pids = [s["pid"] for s in mgr.stats()]
        waiting, gate = str(tmp_path / "waiting"), str(tmp_path / "gate")
        holder.set_state(forcing_state_dict(model_dir, FORCED), gate=(waiting, gate))
        outcome: list = []

        def update():
            try:
                outcome.append(mgr.update_weights(holder, version=1, policy="drain", timeout=10))
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                outcome.append(exc)

        thread = threading.Thread(target=update)
        thread.start()
        _poll("the first buckets down the chain", lambda: os.path.exists(waiting))
        # Sent straight to the last replica while its gate is closed: it waits there.
        held = mgr.replicas[2].generate.remote("held-1", PROMPT, n=1, width=6)
        os.kill(pids[1], signal.SIGKILL)  # the chain 0 -> 1 -> 2 breaks in the middle
        open(gate, "w").close()
        thread.join(WAIT_S)
        assert not thread.is_alive()
        result = outcome[0]
        assert isinstance(result, dict), result
        # chain-1 died and left; chain-2, cut off behind it, got the update again and serves on.
        assert result["dropped"] == ["chain-1"] and result["caught_up"] == ["chain-2"] and result["replicas"] == 2
        assert set(mgr.dropped) == {"chain-1"} and "died" in mgr.dropped["chain-1"]
        assert mgr.serving() == ["chain-0", "chain-2"] and mgr.version == 1
        # The request that waited at chain-2's gate ran on the new weights.
        r = held.get(timeout=WAIT_S)
        assert set(r.batch["policy_version"].tolist()) == {1} and (r.batch["responses"] == FORCED).all()
        for _ in range(4):
            r = mgr.generate(PROMPT, n=2, width=6)
            assert set(r.batch["policy_version"].tolist()) == {1} and (r.batch["responses"] == FORCED).all()
    finally:
        mgr.shutdown()
