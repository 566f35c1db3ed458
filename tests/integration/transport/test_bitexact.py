"""Bit-exact round trips through a real WorkerGroup, over TCP and over shared memory.

Every tensor dtype the issue names (float32 with NaN/inf/-0.0 bit patterns, bfloat16,
float16, int64, bool), non-contiguous and zero-size tensors, and numpy object arrays in
``non_tensor_batch`` go to the workers and come back: as a ``DP_COMPUTE_PROTO`` batch (split,
echoed, concatenated), as a ``ONE_TO_ALL`` argument (one payload for every rank), and as a
held result fetched after a ``blocking=False`` call. Each case runs once with shared memory
forced for every payload (threshold 1 byte) and once with ``PODIUM_DISABLE_SHM`` semantics
(TCP only); the client and worker counters prove which path carried the bytes. The shared
memory runs happen twice: through reused segments (podium.transport.shmpool, the default) and through
one-shot segments (what a spent pool budget falls back to).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import podium
from podium.transport import shmsegment
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.dataproto import DataProto
from podium.worker import Dispatch, Worker, register

pytestmark = pytest.mark.timeout(300)

ROWS = 8  # divisible by the group size: DP_COMPUTE_PROTO splits without padding


class Mirror(Worker):
    """Sends back exactly what it got."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data):
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def echo_later(self, data):
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def echo_value(self, value):
        return value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pooled_bytes(self):
        return shmsegment.budget.used

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shm_stats(self):
        from podium.worker.host.process import current_host

        stats = current_host().stats
        return stats["shm_in"], stats["shm_out"]


@pytest.fixture(scope="module", params=["pooled", "oneshot"])
def wg(request):
    """A group whose shared-memory payloads go through reused segments, or one-shot ones
    (a pool budget of 0 on both sides: the fallback of a spent budget)."""
    env = {"PODIUM_SHM_THRESHOLD_BYTES": "1"}
    if request.param == "oneshot":
        env["PODIUM_SHM_POOL_BYTES"] = "0"
        shmsegment.budget.limit = 0  # this controller's fresh pools for this group create nothing
    podium.init()
    try:
        group = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Mirror),
                            worker_env=env)
        yield group
        pooled = [w.client.segments.pool.segments for w in group.workers], group.pooled_bytes()
        group.shutdown()
        if request.param == "oneshot":
            assert pooled == ([0, 0], [0, 0]), pooled
        else:
            assert all(pooled[0]) and all(pooled[1]), pooled  # the pooled path was taken
    finally:
        shmsegment.budget.limit = None
        podium.shutdown()


@pytest.fixture(params=["shm", "tcp"])
def transport(request, wg):
    """Point every client of the group at one path (shm: every payload; tcp: none)."""
    for w in wg.workers:
        w.client.same_host = request.param == "shm"
        w.client.shm_threshold = 1
    yield request.param
    for w in wg.workers:
        w.client.same_host = True
        w.client.shm_threshold = 1 << 20


def float_specials(shape, dtype):
    """Values whose bit patterns a lossy path would change: NaN payloads, ±inf, -0.0, subnormals."""
    t = torch.randn(shape, dtype=torch.float32)
    flat = t.view(-1)
    flat[:6] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-45, 3.0e38])
    t = t.to(dtype)
    if dtype == torch.float32:  # a NaN with a non-default payload
        t.view(torch.int32).view(-1)[0] = 0x7FC12345
    return t


def tensors() -> dict[str, torch.Tensor]:
    """One tensor per case, ROWS rows each."""
    base = torch.arange(ROWS * 12, dtype=torch.int64).reshape(ROWS, 12)
    return {
        "f32": float_specials((ROWS, 5), torch.float32),
        "bf16": float_specials((ROWS, 7), torch.bfloat16),
        "f16": float_specials((ROWS, 3), torch.float16),
        "i64": base * -7919 + (1 << 40),
        "bool": torch.rand(ROWS, 9) > 0.5,
        "noncontig_cols": base[:, ::3],                       # strided columns
        "noncontig_t": torch.randn(6, ROWS).t(),              # transposed
        "zero_cols": torch.empty(ROWS, 0, dtype=torch.float32),
        "zero_inner": torch.empty(ROWS, 2, 0, dtype=torch.bfloat16),
    }


def objects() -> np.ndarray:
    """A numpy object array of mixed Python values, one per row."""
    values = [{"k": i, "nested": [i, None]} if i % 3 == 0 else (f"row-{i}" if i % 3 == 1 else (i, b"\x00\xff"))
              for i in range(ROWS)]
    array = np.empty(ROWS, dtype=object)
    array[:] = values
    return array


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def check_proto(out: DataProto, sent: DataProto) -> None:
    assert sorted(out.batch.keys()) == sorted(sent.batch.keys())
    for key in sent.batch.keys():
        assert same_bits(out.batch[key], sent.batch[key]), key
    objs = out.non_tensor_batch["objs"]
    assert objs.dtype == object and objs.shape == (ROWS,)
    assert list(objs) == list(sent.non_tensor_batch["objs"])
    assert out.meta_info == sent.meta_info


def shm_counters(wg) -> tuple[int, int, int, int]:
    """(controller sent, controller received, workers took in, workers sent out) through shm."""
    sent = sum(w.client.stats["shm_sent"] for w in wg.workers)
    received = sum(w.client.stats["shm_received"] for w in wg.workers)
    per_worker = wg.shm_stats()
    return sent, received, sum(i for i, _ in per_worker), sum(o for _, o in per_worker)


def assert_path(wg, transport: str, before: tuple) -> None:
    # shm_stats itself travels over shm when forced; counters only ever grow.
    after = shm_counters(wg)
    moved = [a - b for a, b in zip(after, before)]
    if transport == "shm":
        assert all(m > 0 for m in moved), moved
    else:
        assert moved == [0, 0, 0, 0], moved


def test_dp_compute_proto_is_bit_exact(wg, transport):
    before = shm_counters(wg)
    sent = DataProto.from_dict(tensors=tensors(), non_tensors={"objs": objects()}, meta_info={"step": 3})
    for key, t in sent.batch.items():
        if key.startswith("noncontig"):
            assert not t.is_contiguous()
    out = wg.echo(sent)
    check_proto(out, sent)
    assert_path(wg, transport, before)


def test_one_to_all_values_are_bit_exact(wg, transport):
    before = shm_counters(wg)
    cases = list(tensors().values()) + [torch.empty(0, dtype=torch.int64), torch.tensor(True),
                                       torch.arange(40, dtype=torch.float16).reshape(5, 8)[1::2, 1::3]]
    value = {"tensors": cases, "objs": objects(), "array": np.arange(24, dtype=np.int16).reshape(4, 6)[:, ::2]}
    outs = wg.echo_value(value)
    assert len(outs) == wg.world_size
    for out in outs:
        assert len(out["tensors"]) == len(cases)
        for got, want in zip(out["tensors"], cases):
            assert same_bits(got, want)
        assert list(out["objs"]) == list(value["objs"])
        assert out["array"].dtype == np.int16 and np.array_equal(out["array"], value["array"])
    assert_path(wg, transport, before)


def test_held_results_fetch_bit_exact(wg, transport):
    before = shm_counters(wg)
    sent = DataProto.from_dict(tensors=tensors(), non_tensors={"objs": objects()}, meta_info={"held": True})
    future = wg.echo_later(sent)
    check_proto(podium.get(future), sent)
    # and a row range that straddles both workers' results
    part = podium.get(future.slice(ROWS // 2 - 1, ROWS // 2 + 2))
    for key in sent.batch.keys():
        assert same_bits(part.batch[key], sent.batch[key][ROWS // 2 - 1:ROWS // 2 + 2]), key
    assert list(part.non_tensor_batch["objs"]) == list(sent.non_tensor_batch["objs"][ROWS // 2 - 1:ROWS // 2 + 2])
    assert_path(wg, transport, before)


def test_large_payload_is_bit_exact(wg, transport):
    # Several 4 MiB chunks on TCP; one segment each way on shm.
    before = shm_counters(wg)
    big = torch.randint(-2**62, 2**62, (ROWS, 300_000), dtype=torch.int64)  # ~19 MiB
    sent = DataProto.from_dict(tensors={"big": big, "bf": float_specials((ROWS, 100_001), torch.bfloat16)},
                               non_tensors={"objs": objects()})
    out = wg.echo(sent)
    check_proto(out, sent)
    assert_path(wg, transport, before)
