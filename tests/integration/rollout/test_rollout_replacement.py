"""Rollout replicas that come back: a RolloutServerManager replaces a replica killed
(SIGKILL) while requests are in flight, from a warm standby first and then by starting a new
one. The requests on the dead replica fail with a typed error; the replacement loads the
current weights through the broadcast before it serves, rejoins the balancer, and takes the
next update like the others. Real worker processes, real in-process vLLM engines on CPU;
skipped, naming vLLM, where it is not installed."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.integration.rollout.test_rollout_servers import FORCED, PROMPT, WAIT_S, Holder, _config, _poll
from tests.support.rollout_kit import forcing_state_dict, original_state_dict, vllm_marks

pytestmark = [*vllm_marks, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def holder(cluster):
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup

    wg = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Holder),
                     name_prefix="holder")
    yield wg
    wg.shutdown()


def _direct(mgr, slot: int):
    """A request sent straight to the replica in ``slot`` (bypassing the balancer)."""
    return mgr.replicas[slot].generate.remote(f"direct-{time.monotonic_ns()}", PROMPT, n=2,
                                              width=6).get(timeout=WAIT_S)


def _kill_with_requests_in_flight(mgr, slot: int) -> tuple[int, list, float]:
    from podium.errors import PodiumError

    victim = mgr.stats()[slot]["pid"]
    futures = [mgr.submit(PROMPT, n=4, width=6) for _ in range(4)]  # two per replica
    _poll("requests in the victim's engine", lambda: any(
        s["pid"] == victim and s["in_flight"] for s in mgr.stats()))
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    outcomes = []
    for f in futures:
        try:
            outcomes.append(f.result(WAIT_S))
        except PodiumError as exc:  # typed: the caller knows the replica died
            outcomes.append(exc)
    return victim, outcomes, killed


def _back(mgr, slot: int, count: int, killed: float) -> dict:
    name = mgr.names[slot]
    _poll(f"{name} replaced and back in rotation", lambda: len(mgr.healer.replacements) >= count
          and name in mgr.serving())
    entry = mgr.healer.replacements[count - 1]
    assert entry["replica"] == name
    # Reported, not asserted (tests never assert a time): from the SIGKILL to back in rotation.
    print(f"\n{name}: back in rotation {time.monotonic() - killed:.2f} s after the kill; {entry}")
    return entry


def test_a_killed_replica_is_replaced_with_the_current_weights_and_takes_the_next_update(holder, model_dir):
    from podium.errors import WorkerDiedError
    from podium.rollout.servermanager import RolloutServerManager

    mgr = RolloutServerManager.launch(_config(model_dir), replicas=2, max_requests=2, name_prefix="heal",
                                      standby=1, health_interval=0.5)
    try:
        standby_pid = None
        holder.set_state(forcing_state_dict(model_dir, FORCED))
        assert mgr.update_weights(holder, version=1, timeout=60)["replicas"] == 2

        # 1. From the standby: the replica in slot 1 dies with requests in flight.
        victim, outcomes, killed = _kill_with_requests_in_flight(mgr, 1)
        # Each request in flight either finished before the kill (on a busy machine the
        # victim's can) or failed typed; none is lost or wrong.
        died = [o for o in outcomes if isinstance(o, Exception)]
        assert len(outcomes) == 4 and all(isinstance(o, WorkerDiedError) for o in died), outcomes
        assert all(set(o.batch["policy_version"].tolist()) == {1} for o in outcomes if not isinstance(o, Exception))
        first = _back(mgr, 1, 1, killed)
        assert first["from"] == "standby" and first["version"] == 1 and "died" in first["why"]
        pid = mgr.stats()[1]["pid"]
        assert pid != victim and not mgr.healer.standbys
        standby_pid = pid
        # It took the current weights (version 1, forcing) before its first request.
        r = _direct(mgr, 1)
        assert set(r.batch["policy_version"].tolist()) == {1} and (r.batch["responses"] == FORCED).all()

        # 2. No standby left: a new replica is started for slot 0.
        victim0, _, killed = _kill_with_requests_in_flight(mgr, 0)
        second = _back(mgr, 0, 2, killed)
        assert second["from"] == "new" and second["version"] == 1
        assert mgr.stats()[0]["pid"] not in (victim0, standby_pid)
        r = _direct(mgr, 0)
        assert set(r.batch["policy_version"].tolist()) == {1} and (r.batch["responses"] == FORCED).all()

        # 3. Both replacements take the next update like any replica.
        holder.set_state(original_state_dict(model_dir))
        update = mgr.update_weights(holder, version=2, timeout=60)
        assert update["replicas"] == 2 and update["dropped"] == [] and mgr.serving() == mgr.names
        for slot in (0, 1):
            r = _direct(mgr, slot)
            assert set(r.batch["policy_version"].tolist()) == {2} and not (r.batch["responses"] == FORCED).all()
    finally:
        mgr.shutdown()


def test_an_unresponsive_replica_is_fenced_and_replaced(holder, model_dir):
    from podium.rollout.servermanager import RolloutServerManager

    mgr = RolloutServerManager.launch(_config(model_dir), replicas=2, max_requests=2, name_prefix="stop",
                                      standby=1, health_interval=0.5, probe_timeout=2.0)
    try:
        holder.set_state(forcing_state_dict(model_dir, FORCED))
        mgr.update_weights(holder, version=1, timeout=60)
        stopped = mgr.stats()[1]["pid"]
        os.kill(stopped, signal.SIGSTOP)  # alive, but answers nothing
        killed = time.monotonic()
        entry = _back(mgr, 1, 1, killed)
        assert entry["from"] == "standby" and "did not answer" in entry["why"] and entry["version"] == 1

        def gone() -> bool:  # fenced: the stopped process was killed, never to serve again
            try:
                os.kill(stopped, 0)
            except ProcessLookupError:
                return True
            try:
                with open(f"/proc/{stopped}/stat") as f:  # a zombie not yet reaped is dead too
                    return f.read().split(") ", 1)[1].startswith("Z")
            except FileNotFoundError:  # reaped between the two looks
                return True

        _poll("the stopped replica's process killed", gone)
        assert mgr.stats()[1]["pid"] != stopped and mgr.serving() == mgr.names
        r = _direct(mgr, 1)
        assert set(r.batch["policy_version"].tolist()) == {1} and (r.batch["responses"] == FORCED).all()
    finally:
        mgr.shutdown()
