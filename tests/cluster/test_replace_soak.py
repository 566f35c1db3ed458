"""The replacement soak, short (issue #51, goal "0 ranks live twice"): a group with
``on_rank_death="replace"`` on real scheduler and agent processes, one rank SIGKILLed or
SIGSTOPped ten times in a row (standbys and fresh workers both take ranks); after each
replacement no rank is live twice (process table, the scheduler's records, each rank's own
answer), a stopped-then-continued replaced process stays gone, and at the end no process,
slot or segment is left. ``PODIUM_REPLACE_SOAK_FAULTS`` and ``PODIUM_REPLACE_SOAK_SEED``
change the count and the seed; the long run is ``python -m bench.replace_soak``.
"""

from __future__ import annotations

import os

import pytest

from tests.support.replacesoak import STANDBY, ReplaceSoak, soak_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.faults, pytest.mark.timeout(900)]

FAULTS = int(os.environ.get("PODIUM_REPLACE_SOAK_FAULTS", "10"))
SEED = int(os.environ.get("PODIUM_REPLACE_SOAK_SEED", "51"))


def test_replaced_ranks_are_never_live_twice(tmp_path):
    with soak_cluster(tmp_path) as agents:
        soak = ReplaceSoak(agents, FAULTS, SEED, per_group=5).run()
    print("\n" + soak.table())
    assert soak.injected["kill"] + soak.injected["stop"] == FAULTS and soak.injected["stop"] == FAULTS // 2
    assert sum(soak.sources.values()) == FAULTS
    assert soak.sources["standby"] >= STANDBY and soak.sources["fresh worker"] > 0
    assert soak.failures() == []
