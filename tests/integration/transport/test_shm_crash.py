"""A worker killed while a shared-memory payload is in flight leaves no segment behind.

Two directions: the controller wrote a large argument into a segment and sent its name to a
worker that is SIGKILLed before it maps it (the controller removes it when the call fails);
and a worker that wrote a segment and died before any reader came (the node agent removes
what the pid it reaped created). Other tests' segments may exist meanwhile, so only names
carrying this test's pids count.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time

import pytest
import torch

import podium
from podium.transport import shm
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.errors import PodiumError, WorkerDiedError
from podium.worker import Dispatch, Worker, register
from tests.support.shmfiles import segments_of
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(180)


class Fragile(Worker):
    """Methods that block the worker's event loop, take a payload, or die after writing a segment."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def block_loop(self, seconds, marker):
        pathlib.Path(marker).touch()  # the test waits for this: the loop is now blocked
        time.sleep(seconds)  # on the event loop on purpose: later frames stay unread

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def take(self, tensor):
        return tensor.numel()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def write_then_die(self, nbytes):
        shm.write_segments([bytes(nbytes)])
        os.kill(os.getpid(), signal.SIGKILL)


def sizes_of(names: list[str]) -> list[int]:
    """Sizes of the segments that still exist."""
    sizes = []
    for name in names:
        try:
            sizes.append(os.stat(os.path.join(shm.SHM_DIR, name)).st_size)
        except FileNotFoundError:
            pass
    return sizes


@pytest.fixture(scope="module")
def crash_cluster():
    podium.init()
    yield
    podium.shutdown()


def one_worker() -> WorkerGroup:
    return WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Fragile))


def test_worker_killed_before_it_maps_the_argument(crash_cluster, tmp_path):
    wg = one_worker()
    try:
        worker = wg.workers[0]
        assert worker.client.same_host  # the embedded cluster is on this host: shm is on
        marker = tmp_path / "loop-blocked"
        blocker = wg.block_loop(60, str(marker))
        eventually(marker.exists, "the blocking call to reach the worker's loop")
        payload = torch.ones(16 << 20, dtype=torch.float32)  # 64 MiB: far above the threshold
        sent = worker.client.stats["shm_sent"]
        pending = wg.take(payload)
        # Wait until the whole argument is in its segment and the frame naming it is written
        # (the client counts it as it writes): the worker's loop is blocked, so nobody maps it.
        eventually(lambda: max(sizes_of(segments_of(os.getpid())), default=0) >= payload.nbytes, "the argument to reach shared memory", 30)
        eventually(lambda: worker.client.stats["shm_sent"] > sent, "the frame naming the segment to be written")
        assert segments_of(os.getpid())
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(PodiumError) as caught:
            podium.get(pending, timeout=60)
        assert isinstance(caught.value, WorkerDiedError), caught.value
        with pytest.raises(PodiumError):
            podium.get(blocker, timeout=60)
        eventually(lambda: not segments_of(os.getpid(), worker.pid), "the dead worker's segments to be removed", 30)
    finally:
        wg.shutdown()


def test_worker_dies_after_writing_a_segment(crash_cluster):
    wg = one_worker()
    try:
        pid = wg.workers[0].pid
        with pytest.raises(WorkerDiedError):
            wg.write_then_die(3 << 20)
        # the agent reaps the worker and removes what that pid created
        eventually(lambda: not segments_of(pid), "the segments of the dead process to be removed", 30)
    finally:
        wg.shutdown()
