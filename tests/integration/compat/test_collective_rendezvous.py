"""ray.util.collective's rendezvous under `podium run` after a failed attempt (issue #48): a
rank that finds an earlier attempt's address waits for the current one, and a failed rank 0
removes the rendezvous actor. The program: collective_rendezvous_program.py."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

PROGRAM = pathlib.Path(__file__).with_name("collective_rendezvous_program.py")


def test_a_stale_rendezvous_is_waited_out_and_a_failed_one_removed():
    done = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--num-cpus", "8", "--", sys.executable,
                           str(PROGRAM)], capture_output=True, text=True, timeout=280, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "SCENARIO OK" in done.stdout, out[-4000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert lines["rank 1 reached the old port"] == "True"
    assert lines["collective"] == "[[3.0, 3.0], [3.0, 3.0]]"
    assert lines["alone"].startswith("failed: ")
    assert lines["actor left"] == "False"
