"""Actor handles and refs that travel between processes, awaited refs, and waits as long as
Ray's: a plain ``import ray`` program (travel_program.py) under ``podium run``, on one host and
across two loopback nodes with shared memory off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.clusters import two_node_processes

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

HERE = Path(__file__).parent

EXPECTED = {
    "write": "[True, True]",
    "read through dataclass": "5",
    "nested kinds": "['True']",
    "nested total": "8",
    "nested to a task": "8",
    "refs from a result": "[10, 5]",
    "handle from a result": "5 True",
    "ping while awaiting": "pong long call running",
    "awaited in actor": "2.0",
    "gather in actor": "[0.05, 0.05, 0.05, 0.05]",
    "wait_for in actor": "timeout",
    "error awaited in actor": "RemoteError",
    "driver await": "0.05",
    "driver gather": "[0.02, 0.02, 0.02]",
    "driver wait_for": "timeout",
    "driver future": "0.01",
    "driver wrap_future": "0.01",
    "driver await put": "7",
    "driver await error": "RemoteError True",
    "owner alive": "[0, 1, 2, 3, 4]",
    "owner dead": "OwnerDiedError",
}


def _podium_run(options: list[str], script: str, **env: str) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-m", "podium.cli", "run", *options, "--", sys.executable, script],
                          cwd=HERE, env={**os.environ, **env}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "PROGRAM OK" in done.stdout, (done.stdout + done.stderr)[-5000:]
    return dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)


def _check(lines: dict[str, str]) -> None:
    assert {k: lines.get(k) for k in EXPECTED} == EXPECTED
    died = lines["borrowed handle of a dead actor"]
    assert died.startswith("ActorDiedError: ") and "actor:Store-" in died, died


def test_handles_refs_and_awaits_on_one_host():
    _check(_podium_run(["--num-cpus", "16", "--num-gpus", "4"], "travel_program.py"))


def test_handles_refs_and_awaits_across_two_hosts_over_tcp(tmp_path, monkeypatch):
    # Shared memory off for every process (the agents pass it to their workers): TCP only.
    monkeypatch.setenv("PODIUM_SHM_THRESHOLD_BYTES", str(1 << 62))
    with two_node_processes(tmp_path, gpus_per_node=2) as cluster:
        lines = _podium_run(["--address", cluster.address], "travel_program.py", PODIUM_TOKEN=cluster.token)
    _check(lines)


def _long_get(mode: str, **env: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if k != "PODIUM_CALL_TIMEOUT"}
    done = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "4", "--", sys.executable,
                           "long_get_program.py", mode], cwd=HERE, env={**clean, **env}, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0 and "PROGRAM OK" in done.stdout, (done.stdout + done.stderr)[-5000:]
    return dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)


def test_a_get_waits_as_long_as_its_worker_lives():
    lines = _long_get("long")
    assert lines["default deadline"] == "None" and lines["long get"] == "done"


def test_a_deadline_set_by_choice_still_ends_the_get():
    lines = _long_get("deadline", PODIUM_CALL_TIMEOUT="5")
    assert lines["deadline"].startswith("DeadlineExceededError") and "5s" in lines["deadline"], lines


def test_an_actor_whose_handle_was_dropped_answers_the_calls_made_through_it():
    # main_ppo's shape without the variable: ray.get(TaskRunner.remote().run.remote(config)).
    assert _long_get("unkept")["unkept"] == "done"


def test_a_get_without_deadline_ends_when_its_worker_dies():
    assert _long_get("dies")["dies"] == "WorkerDiedError True"


def test_a_ref_keeps_its_value_alive_in_whichever_process_holds_it():
    lines = _podium_run(["--num-cpus", "8"], "borrow_program.py")
    assert lines["kept for its borrower"] == "True"  # the driver dropped its ref; an actor keeps it
    assert lines["borrower reads"] == "{'weights': 42}"
    assert lines["passed on"] == "True"  # A handed it to B and dropped its own copy
    assert lines["second borrower reads"] == "{'weights': 42} True"
    assert lines["freed with its last borrow"] == "True True"  # no leak: back to the baseline
    assert lines["kept for the doomed borrower"] == "True"
    assert lines["freed when its borrower died"] == "True True"
    assert lines["kept by a constructor"] == "given to a constructor"
    # A ref inside a put value lives as long as that value, wherever it is kept.
    assert lines["kept by the value holding it"] == "True True"
    assert lines["read through the outer value here"] == "inner value"
    assert lines["outer kept for its borrower"] == "True True"
    assert lines["borrower reads the nested ref"] == "inner value"
    assert lines["freed with the outer value"] == "True True"  # both, back to the baseline
    assert lines["nested ref kept alone"] == "True"
    assert lines["outer freed, inner borrowed"] == "True True inner kept alone"
    assert lines["inner freed with its borrow"] == "True True"
    assert lines["nested in a worker's store"] == "('inner put by a worker', True)"
    assert lines["borrowed from a worker"] == "[0, 1, 2]"
