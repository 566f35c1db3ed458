"""Results computed in place in the call's argument go back as references, not copies.

A same-host call's argument arrives in a shared-memory segment the controller owns (one rank:
the connection's pooled segment; two or more: one staged segment for the whole group call,
podium.transport.shmstage). A method that changes its batch in place and returns it
(``data.batch[k] += 1; return data``) has its result in that very segment. The worker then
sends references into it instead of copying the result into a segment of its own, provided it
kept no view of the argument, so the controller's value is still a snapshot
(``SyncInvoker.package``); the ranks' rows, adjacent in the staged segment, concatenate into a
view of it. These tests check the values bit for bit, that references were used exactly when
allowed, that neither side sees the other's later writes, that a kept result's segment is not
reused, and that every segment is given back and no file is left.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

import podium
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.dataproto import DataProto
from podium.transport.shmstage import STAGE
from podium.worker import Dispatch, Worker, register
from tests.support.shmfiles import segments_of
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(300)

ROWS = 64


def _bump(data):
    for key in list(data.batch.keys()):
        tensor = data.batch[key]
        if tensor.dtype == torch.bool:
            tensor.logical_not_()
        else:
            tensor += 1


class InPlace(Worker):
    """Changes batches in place; some methods keep (a view of) what they were given."""

    def __init__(self):
        super().__init__()
        self.kept = None

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def bump(self, data):
        _bump(data)
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def bump_and_keep(self, data):
        _bump(data)
        self.kept = data
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def bump_and_keep_a_row(self, data):
        _bump(data)
        self.kept = data.batch["x"][0]
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def bump_and_add(self, data):
        _bump(data)
        data.batch["twice"] = data.batch["x"] * 2  # new memory, not in the argument
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def kept_x_sum(self):
        if self.kept is None:
            return None
        kept = self.kept if isinstance(self.kept, torch.Tensor) else self.kept.batch["x"]
        return float(kept.double().sum())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def change_kept(self):
        kept = self.kept if isinstance(self.kept, torch.Tensor) else self.kept.batch["x"]
        kept += 1000

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def drop_kept(self):
        self.kept = None
        gc.collect()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def in_place_replies(self):
        from podium.worker.host.process import current_host

        return current_host().stats["in_place_out"]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def staged_calls(self):
        from podium.worker.host.process import current_host

        return current_host().stats["staged_in"]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def row_sums(self, tensor):
        return float(tensor.double().sum())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


@pytest.fixture(scope="module")
def wg():
    podium.init()
    try:
        group = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(InPlace))
        assert all(w.client.same_host for w in group.workers)
        yield group
        group.shutdown()
    finally:
        podium.shutdown()


def _batch() -> DataProto:
    generator = torch.Generator().manual_seed(7)
    return DataProto.from_dict(
        tensors={
            "x": torch.randn(ROWS, 8192, generator=generator),  # 2 MiB
            "ids": torch.randint(0, 1 << 40, (ROWS, 2048), generator=generator),
            "half": torch.randn(ROWS, 2048, generator=generator).to(torch.bfloat16),
            "mask": torch.rand(ROWS, 4096, generator=generator) > 0.5,
            "strided": torch.randn(4096, ROWS, generator=generator).t(),  # not contiguous
            "small": torch.arange(ROWS, dtype=torch.int32),  # travels in-band
        },
        non_tensors={"text": np.array([f"row {i}" for i in range(ROWS)], dtype=object)})


def _expected(data: DataProto) -> DataProto:
    expected = DataProto.from_dict(tensors={k: v.clone() for k, v in data.batch.items()},
                                   non_tensors=dict(data.non_tensor_batch))
    _bump(expected)
    return expected


def _counts(wg):
    return wg.in_place_replies(), [w.client.stats["in_place_received"] for w in wg.workers]


def _assert_equal(got: DataProto, want: DataProto) -> None:
    assert sorted(got.batch.keys()) == sorted(want.batch.keys())
    for key in want.batch.keys():
        a, b = got.batch[key], want.batch[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(_bits(a), _bits(b)), key
    assert list(got.non_tensor_batch["text"]) == list(want.non_tensor_batch["text"])


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.contiguous()
    return tensor if tensor.dtype == torch.bool else tensor.view(torch.uint8)


def _segment_files(pids) -> list[str]:
    STAGE.close()  # free staged segments are kept (as files) for the next call
    return segments_of(*pids)


def test_a_batch_changed_in_place_comes_back_by_reference_bit_exact(wg):
    data = _batch()
    want = _expected(data)
    sent, received = _counts(wg)
    staged = wg.staged_calls()
    pooled = [w.client.stats["shm_sent"] for w in wg.workers]
    for _ in range(3):
        out = wg.bump(data)
        _assert_equal(out, want)
        del out
    after_sent, after_received = _counts(wg)
    assert [a - b for a, b in zip(after_sent, sent)] == [3, 3]
    assert [a - b for a, b in zip(after_received, received)] == [3, 3]
    assert [a - b for a, b in zip(wg.staged_calls(), staged)] == [3, 3]  # one staged segment per call
    assert [w.client.stats["shm_sent"] for w in wg.workers] == pooled  # not each rank's own segment
    _assert_equal(data, DataProto.from_dict(tensors=dict(_batch().batch.items()),
                                            non_tensors=dict(_batch().non_tensor_batch)))  # untouched


def test_a_worker_that_keeps_its_batch_sends_a_copy_and_neither_side_sees_the_other(wg):
    data = _batch()
    want = _expected(data)
    sent, _ = _counts(wg)
    out = wg.bump_and_keep(data)
    _assert_equal(out, want)
    assert _counts(wg)[0] == sent  # kept: no references
    kept_sums = wg.kept_x_sum()
    out.batch["x"] += 100  # the controller's writes stay here...
    assert wg.kept_x_sum() == kept_sums
    wg.change_kept()  # ...and the worker's stay there
    assert torch.equal(out.batch["x"], want.batch["x"] + 100)
    wg.drop_kept()


def test_a_worker_that_keeps_a_view_of_one_row_sends_a_copy(wg):
    data = _batch()
    sent, _ = _counts(wg)
    out = wg.bump_and_keep_a_row(data)
    _assert_equal(out, _expected(data))
    assert _counts(wg)[0] == sent
    wg.change_kept()
    assert torch.equal(out.batch["x"], _expected(data).batch["x"])
    wg.drop_kept()


def test_a_result_mixing_in_place_and_new_tensors(wg):
    data = _batch()
    want = _expected(data)
    want.batch["twice"] = want.batch["x"] * 2
    sent, _ = _counts(wg)
    out = wg.bump_and_add(data)
    _assert_equal(out, want)
    assert [a - b for a, b in zip(_counts(wg)[0], sent)] == [1, 1]


def test_a_result_kept_at_one_rank_holds_its_segment_and_stays_intact(wg):
    """With one rank nothing is concatenated: the result is a view of the controller's own
    argument segment, which is not written again while the result lives."""
    from podium.controller import ResourcePool as Pool

    one = WorkerGroup(Pool([1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(InPlace))
    try:
        pool = one.workers[0].client.segments.pool
        data = _batch()
        kept = one.bump(data)
        _assert_equal(kept, _expected(data))
        gc.collect()
        eventually(lambda: pool.busy == 1, "only the kept result's segment to stay in use", timeout=30,
                   interval=0.01)
        other = _batch()
        other.batch["x"].fill_(-5.0)
        for _ in range(3):
            out = one.bump(other)
            assert float(out.batch["x"].min()) == float(out.batch["x"].max()) == -4.0
            del out
        _assert_equal(kept, _expected(data))
        del kept
        gc.collect()
        eventually(lambda: pool.busy == 0, "every argument segment to come back", timeout=30, interval=0.01)
        pids = one.pid() + [os.getpid()]
    finally:
        one.shutdown()
    assert _segment_files(pids) == []


def test_the_ranks_rows_of_a_kept_result_are_one_view_of_the_staged_segment(wg):
    data = _batch()
    kept = wg.bump(data)
    gc.collect()
    eventually(lambda: STAGE.in_use == 1, "only the kept result's staged segment to stay in use", timeout=30,
               interval=0.01)
    assert STAGE.span(kept.batch["x"].data_ptr(), kept.batch["x"].nbytes) is not None  # not a copy
    other = _batch()
    other.batch["x"].fill_(-5.0)
    for _ in range(3):  # more calls while it lives take other segments
        out = wg.bump(other)
        assert float(out.batch["x"].min()) == float(out.batch["x"].max()) == -4.0
        del out
    _assert_equal(kept, _expected(data))
    kept.batch["x"] += 1  # the controller may write its result
    assert torch.equal(kept.batch["x"], _expected(data).batch["x"] + 1)
    del kept
    gc.collect()
    eventually(lambda: STAGE.in_use == 0, "the staged segments to come back", timeout=30, interval=0.01)


def test_one_kept_rank_gets_a_copy_while_the_other_sends_references(wg):
    class Mixed(InPlace):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def bump_keep_on_rank_0(self, data):
            _bump(data)
            if self.rank == 0:
                self.kept = data
            return data

    data = _batch()
    mixed = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Mixed))
    try:
        out = mixed.bump_keep_on_rank_0(data)
        _assert_equal(out, _expected(data))
        assert mixed.in_place_replies() == [0, 1]
        before = mixed.kept_x_sum()[0]
        out.batch["x"] += 7
        assert mixed.kept_x_sum()[0] == before
    finally:
        mixed.shutdown()


def test_a_large_one_to_all_argument_is_staged_once_for_every_rank(wg):
    tensor = torch.arange(1 << 20, dtype=torch.float32)
    staged = wg.staged_calls()
    assert wg.row_sums(tensor) == [float(tensor.double().sum())] * 2
    assert [a - b for a, b in zip(wg.staged_calls(), staged)] == [1, 1]


def test_shards_below_the_threshold_are_staged_when_the_call_is_above_it(wg):
    """768 KiB per rank is below the 1 MiB shared-memory threshold, 1.5 MiB in all is not."""
    data = DataProto.from_dict(tensors={"x": torch.randn(ROWS, 6144)})  # 1.5 MiB
    staged, (sent, _) = wg.staged_calls(), _counts(wg)
    out = wg.bump(data)
    assert torch.equal(out.batch["x"], data.batch["x"] + 1)
    assert [a - b for a, b in zip(wg.staged_calls(), staged)] == [1, 1]
    assert [a - b for a, b in zip(_counts(wg)[0], sent)] == [1, 1]


def test_every_segment_goes_back_and_no_file_is_left(wg):
    data = _batch()
    for _ in range(4):
        out = wg.bump(data)
        del out
    gc.collect()
    eventually(lambda: STAGE.in_use == 0 and all(w.client.segments.pool.busy == 0 for w in wg.workers),
               "every argument segment to come back", timeout=30, interval=0.01)
    assert STAGE.segments <= 2  # reused, not one per call
    assert _segment_files(wg.pid() + [os.getpid()]) == []
