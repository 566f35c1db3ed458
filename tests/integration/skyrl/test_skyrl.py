"""SkyRL 0.4.0's own classes, from its PyPI wheel, on Podium under ``podium run``: its worker
group (``PPORayActorGroup`` building SkyRL ``Worker`` actors on a placement group), its dispatch
(``MeshDispatch``, ``PassThroughDispatch``, ``DispatchRegistry``), and its named-actor function
registries. Each scenario is a script with plain ``import ray`` that asserts what it checks
and prints ``SCENARIO OK``. Needs ``tools/install-skyrl.sh`` (.venv-skyrl: Python 3.12, the
skyrl wheel without its dependencies, no Ray)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
HAVE_SKYRL = importlib.util.find_spec("skyrl") is not None
pytestmark = [pytest.mark.skyrl,
              pytest.mark.skipif(not HAVE_SKYRL, reason="skyrl is not installed (tools/install-skyrl.sh makes "
                                                        ".venv-skyrl with the skyrl 0.4.0 wheel on Python 3.12)"),
              pytest.mark.timeout(300)]


def podium_run(script: str, *options: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PODIUM_ADDRESS",)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run([sys.executable, "-m", "podium.cli", "run", *options, "--", sys.executable, script],
                          cwd=HERE, env=env, check=False, capture_output=True, text=True, timeout=280)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "SCENARIO OK" in done.stdout, output[-6000:]
    return output


def test_skyrls_worker_group_and_dispatch():
    podium_run("scenario_worker_group.py", "--num-cpus", "16", "--num-gpus", "4")


def test_skyrls_named_actor_registries():
    podium_run("scenario_registries.py")
