"""Issue #14, item 2: ``get`` of several refs, ``DataProtoFuture.get``, ``wait`` and a
blocking group call fail as soon as one rank dies, while the other ranks still run; the
other ranks' refs stay valid and are fetched once they finish."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import podium
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.dataproto import DataProto
from podium.errors import WorkerDiedError
from podium.worker import Dispatch, Worker, register
from tests.support.clusters import controller_cluster

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

#: How long rank 0 waits for its gate at most (an error that waits for it takes this long).
GATE_SECONDS = 30


def _rank0_waits_rank1_dies(rank: int, gate: str) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + GATE_SECONDS
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)


class HalfDies(Worker):
    """Rank 1 is SIGKILLed at once; rank 0 finishes once the gate file exists."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def later(self, gate):
        _rank0_waits_rank1_dies(self.rank, gate)
        return self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def rows(self, data):
        _rank0_waits_rank1_dies(self.rank, data.meta_info["gate"])
        data.batch["a"] += 1
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def now(self, gate, done):
        _rank0_waits_rank1_dies(self.rank, gate)
        with open(done, "w") as handle:
            handle.write("finished")
        return self.rank


@pytest.fixture(scope="module", autouse=True)
def cluster(tmp_path_factory):
    with controller_cluster("embedded", tmp_path_factory.mktemp("embedded")):
        yield


@pytest.fixture
def group():
    wg = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(HalfDies))
    try:
        yield wg
    finally:
        wg.shutdown()


def test_get_of_a_list_raises_when_one_rank_dies_and_the_other_ref_stays_valid(group, tmp_path):
    gate = tmp_path / "gate"
    refs = group.later(str(gate))
    started = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        podium.get(refs)
    print(f"\nget(list) raised {time.monotonic() - started:.2f} s after the call (rank 0 still busy)")
    assert info.value.rank == 1
    assert not refs[0].done(), "get waited for the surviving rank"
    gate.write_text("go")
    assert podium.get(refs[0]) == 0
    assert podium.get(refs[0:1]) == [0]


def test_a_data_proto_future_fails_fast_in_get_and_counts_as_ready_in_wait(group, tmp_path):
    gate = tmp_path / "gate"
    data = DataProto.from_dict(tensors={"a": torch.zeros(4, dtype=torch.long)}, meta_info={"gate": str(gate)})
    future = group.rows(data)
    ready, not_ready = podium.wait([future], num_returns=1, timeout=GATE_SECONDS * 2)
    assert ready == [future] and not_ready == []
    producers = future._pending_refs()
    assert not producers[0].done(), "wait waited for the surviving rank"
    with pytest.raises(WorkerDiedError):
        podium.get(future)
    with pytest.raises(WorkerDiedError):
        future.get()
    gate.write_text("go")
    assert podium.get(producers[0]).batch["a"].tolist() == [1, 1]


def test_a_blocking_call_fails_when_one_rank_dies_while_the_other_still_runs(group, tmp_path):
    gate, done = tmp_path / "gate", tmp_path / "done"
    with pytest.raises(WorkerDiedError) as info:
        group.now(str(gate), str(done))
    assert info.value.rank == 1
    assert not done.exists(), "the call waited for the surviving rank"
    gate.write_text("go")
