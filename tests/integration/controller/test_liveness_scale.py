"""Liveness at scale (issue 33, item 5): the health check of N busy ranks costs one silence
bound, not N of them.

256 workers nap in one call while 8 of them are SIGSTOPped: every busy rank is pinged at
once on a connection of its own (``podium.controller.session.liveness``), so the call fails with one
``UnresponsiveError`` that names exactly the 8 stopped ranks, and the 248 others, which kept
answering, are named by nothing. The time it took is printed, not asserted
(``python -m bench.liveness_scale`` measures it against the bound).
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

import podium
from podium import errors
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.controller.session.runtime import get_runtime
from podium.worker import Dispatch, Worker, register

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

N = 256
STOPPED = 8
#: The liveness bound here: above the default's fifth, so that 256 ranks on two cores
#: answer their pings in time while the test stays short.
SILENCE = 5.0


class Napper(Worker):
    """Naps, and says who it is."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nap(self, seconds):
        time.sleep(seconds)
        return self.rank


def test_256_busy_ranks_with_8_stopped_fail_once_naming_exactly_those_8():
    podium.init(num_cpus=N, log_to_driver=False)
    try:
        get_runtime().deathwatch.liveness.silence = SILENCE
        wg = WorkerGroup(ResourcePool([N], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Napper))
        try:
            pids = wg.pid()
            stopped = sorted(random.Random(33).sample(range(N), STOPPED))
            for rank in stopped:
                os.kill(pids[rank], signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(errors.UnresponsiveError) as info:
                    wg.nap(120)
                print(f"\n{STOPPED} of {N} ranks found silent {time.monotonic() - started:.1f} s after "
                      f"the call (bound {SILENCE:g} s + a ping interval of {SILENCE / 5:g} s)")
            finally:
                for rank in stopped:
                    os.kill(pids[rank], signal.SIGCONT)
            err = info.value
            assert sorted(err.ranks) == stopped
            for rank in stopped:
                assert f"pid {pids[rank]}" in str(err)
        finally:
            wg.shutdown()
    finally:
        podium.shutdown()
