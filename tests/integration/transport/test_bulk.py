"""Large payloads across hosts: bulk frames on the raw call socket, through a real WorkerGroup.

Every client treats its peers as remote (``PODIUM_DISABLE_SHM``: no shared memory, what
a worker on another host gets), so every payload of 64 KiB or more goes as one bulk frame, both ways. Each
size class (just below the bulk threshold, at it, above one chunk, tens of MiB), every
dtype the wire carries (NaN payloads, bfloat16, bool, int64, non-contiguous, zero-size)
and numpy object arrays must come back bit for bit; the client's and the workers'
counters prove the bulk path carried them. A steady loop reuses its receive memory.
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
from podium.controller.session.runtime import get_runtime
from podium.memorypool import POOL
from podium.transport.payload import prepare
from podium.worker import Dispatch, Worker, register

pytestmark = pytest.mark.timeout(300)

ROWS = 8


class Mirror(Worker):
    """Sends back exactly what it got."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data):
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def echo_value(self, value):
        return value

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def echo_later(self, data):
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def kept(self):
        """A tensor this worker keeps and changes later (weights, a buffer)."""
        if not hasattr(self, "_kept"):
            self._kept = torch.zeros(64 << 20, dtype=torch.uint8)
        return self._kept

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def bump_kept(self):
        self._kept += 1

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def bulk_stats(self):
        from podium.worker.host.process import current_host

        stats = current_host().stats
        return stats["bulk_in"], stats["bulk_out"], stats["shm_in"], stats["shm_out"]


REMOTE = {"PODIUM_DISABLE_SHM": "1"}


@pytest.fixture(scope="module")
def wg():
    """A group whose every client (the controller's, and the workers' own for fetches)
    treats its peers as remote: PODIUM_DISABLE_SHM, what the bench's cross-host mode sets."""
    saved = os.environ.get("PODIUM_DISABLE_SHM")
    os.environ.update(REMOTE)
    podium.init()
    try:
        group = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Mirror),
                            worker_env=REMOTE)
        assert all(w.client.transport == "socket" and w.client.same_host is False for w in group.workers)
        yield group
        group.shutdown()
    finally:
        podium.shutdown()
        if saved is None:
            os.environ.pop("PODIUM_DISABLE_SHM", None)
        else:
            os.environ["PODIUM_DISABLE_SHM"] = saved


def counters(wg) -> list[int]:
    sent = sum(w.client.stats["bulk_sent"] for w in wg.workers)
    received = sum(w.client.stats["bulk_received"] for w in wg.workers)
    per_worker = wg.bulk_stats()
    return [sent, received, sum(s[0] for s in per_worker), sum(s[1] for s in per_worker),
            sum(s[2] + s[3] for s in per_worker)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                         b.contiguous().view(-1).view(torch.uint8))


def batch(cols: int) -> DataProto:
    """ROWS rows of every dtype case, about ``ROWS * cols * 13`` bytes in all."""
    f32 = torch.randn(ROWS, cols)
    f32.view(-1)[:4] = torch.tensor([float("nan"), float("-inf"), -0.0, 1e-45])
    f32.view(torch.int32).view(-1)[0] = 0x7FC12345  # a NaN with a payload
    wide = torch.randn(ROWS, 2 * cols)
    objs = np.empty(ROWS, dtype=object)
    objs[:] = [{"row": i, "tag": b"\x00\xff" * i} for i in range(ROWS)]
    return DataProto.from_dict(tensors={
        "f32": f32,
        "bf16": torch.randn(ROWS, cols).to(torch.bfloat16),
        "i64": torch.randint(-(1 << 40), 1 << 40, (ROWS, max(1, cols // 4))),
        "bool": torch.rand(ROWS, cols) > 0.5,
        "strided": wide[:, ::2],
        "transposed": torch.randn(cols, ROWS).t(),
        "empty": torch.empty(ROWS, 0),
    }, non_tensors={"objs": objs}, meta_info={"cols": cols})


# Per rank (the batch splits over 2 ranks): below 64 KiB, just above, above one 4 MiB
# chunk, and tens of MiB.
@pytest.mark.parametrize("cols", [100, 1400, 60_000, 400_000])
def test_dp_compute_proto_across_hosts_is_bit_exact(wg, cols):
    before = counters(wg)
    sent = batch(cols)
    out = wg.echo(sent)
    for key in sent.batch.keys():
        assert same_bits(out.batch[key], sent.batch[key]), key
    assert list(out.non_tensor_batch["objs"]) == list(sent.non_tensor_batch["objs"])
    assert out.meta_info == sent.meta_info
    moved = [a - b for a, b in zip(counters(wg), before)]
    assert moved[4] == 0  # never shared memory
    bulk = cols >= 1400
    # calls out, replies back, on both sides (bulk_stats' own tiny calls are not bulk)
    assert moved[:4] == ([2, 2, 2, 2] if bulk else [0, 0, 0, 0]), moved


def test_one_to_all_sends_one_payload_to_every_rank_as_bulk(wg):
    value = {"t": torch.arange(1 << 20, dtype=torch.int32)[::2], "objs": np.array([1, "a", None], dtype=object),
             "array": np.arange(300_000, dtype=np.int16).reshape(3, -1)[:, ::3]}
    before = counters(wg)
    outs = wg.echo_value(value)
    moved = [a - b for a, b in zip(counters(wg), before)]
    assert moved == [2, 2, 2, 2, 0], moved
    for out in outs:
        assert same_bits(out["t"], value["t"])
        assert list(out["objs"]) == list(value["objs"])
        assert np.array_equal(out["array"], value["array"]) and out["array"].dtype == np.int16


def test_held_results_cross_hosts_as_bulk_to_the_controller_and_to_another_group(wg):
    sent = batch(60_000)
    before = counters(wg)
    future = wg.echo_later(sent)
    got = podium.get(future)  # the controller fetches each rank's held shard
    moved = [a - b for a, b in zip(counters(wg), before)]
    # calls out as bulk, held there; each shard fetched back as a bulk reply (the
    # FETCH_CALL requests themselves are tiny, and fetches take their own clients)
    assert moved == [2, 0, 2, 2, 0], moved
    for key in sent.batch.keys():
        assert same_bits(got.batch[key], sent.batch[key]), key
    # A second group takes the future: each of its workers fetches its rows from the owners.
    readers = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Mirror),
                          worker_env=REMOTE)
    try:
        before = counters(wg)
        out = readers.echo(future)
        moved = [a - b for a, b in zip(counters(wg), before)]
        assert moved[3] >= 2 and moved[4] == 0, moved  # the owners answered with bulk frames
        for key in sent.batch.keys():
            assert same_bits(out.batch[key], sent.batch[key]), key
        assert list(out.non_tensor_batch["objs"]) == list(sent.non_tensor_batch["objs"])
    finally:
        readers.shutdown()


def test_a_reply_is_the_value_at_return_even_if_the_next_call_changes_it(wg):
    # Two calls sent back to back on one connection: the worker runs the second (which
    # changes the tensor in place) while the first one's 64 MiB reply is still leaving.
    client = wg.workers[0].client
    empty = prepare(((), {}))

    async def both():
        first, second = client.submit("kept", empty), client.submit("bump_kept", empty)
        return await first, await second

    before = counters(wg)
    for step in range(3):
        reply, _ = get_runtime().run(both(), timeout=120, what="calls")
        assert int(reply.min()) == step and int(reply.max()) == step, step
    assert counters(wg)[3] - before[3] >= 3  # the replies went as bulk frames


def test_a_steady_loop_reuses_its_receive_memory(wg):
    sent = batch(60_000)
    wg.echo(sent)
    gc.collect()
    made = POOL.created
    for _ in range(5):
        out = wg.echo(sent)
        assert same_bits(out.batch["f32"], sent.batch["f32"])
        del out
        gc.collect()
    assert POOL.created - made <= 2  # replies and the gathered result land in reused mappings
