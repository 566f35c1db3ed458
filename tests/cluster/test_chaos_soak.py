"""The chaos soak, short (issue #31, item 6): a GRPO-shaped job on three namespaced nodes
through a few dozen random faults (worker SIGKILL and SIGSTOP, agent SIGKILL and restart,
scheduler SIGKILL and restart, link down and up, shorter and longer than the lease).

Every call returns or raises a typed error within its bound and nothing hangs; no rank is
ever live twice; no acknowledged placement group is lost across scheduler restarts; after
the job no process, segment or port of it is left. ``PODIUM_CHAOS_FAULTS`` and
``PODIUM_CHAOS_SEED`` change the count and the seed; the long run is ``python -m bench.chaos``.
"""

from __future__ import annotations

import os

import pytest

from tests.support.chaos import ChaosCluster, Soak
from tests.support.netlab import NetLab, unavailable

pytestmark = [pytest.mark.cluster, pytest.mark.faults, pytest.mark.netns, pytest.mark.timeout(1500)]

WHY_NOT = unavailable()
if WHY_NOT:
    pytest.skip(f"no network namespaces here: {WHY_NOT}", allow_module_level=True)

FAULTS = int(os.environ.get("PODIUM_CHAOS_FAULTS", "30"))
SEED = int(os.environ.get("PODIUM_CHAOS_SEED", "31"))


def test_a_job_runs_through_random_faults_and_keeps_every_promise(tmp_path, token):
    with NetLab() as lab:
        cluster = ChaosCluster(lab, tmp_path, token, nodes=3)
        try:
            soak = Soak(cluster, FAULTS, SEED, per_cycle=2).run()
        finally:
            cluster.close()
    print("\n" + soak.table())
    assert sum(soak.injected.values()) == FAULTS
    assert soak.job.steps > FAULTS // 2 and soak.job.counts["ok"] > 0
    assert soak.failures() == []
