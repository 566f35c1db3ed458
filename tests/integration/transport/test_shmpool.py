"""Reused shared-memory segments (podium.transport.shmpool) through a real WorkerGroup.

Same-host payloads go through segments each side keeps and writes again once the other
side is done with them. These tests hold values on both sides while more calls run, so a
segment reused too early would show up as changed data; they also check that a steady
loop reuses a few segments rather than making new ones, and that no file is left behind.
"""

from __future__ import annotations

import asyncio
import gc
import os

import pytest
import torch

import podium
from podium.transport.shmstage import STAGE
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.dataproto import DataProto
from podium.worker import Dispatch, Worker, register
from tests.support.shmfiles import segments_of
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(300)

BIG = 1 << 19  # float32 elements: 2 MiB, above the 1 MiB shared-memory threshold


class Keeper(Worker):
    """Keeps what it is given and makes big results."""

    def __init__(self):
        super().__init__()
        self.kept = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def keep(self, tensor):
        self.kept.append(tensor)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def kept_values(self):
        return [(float(t.min()), float(t.max())) for t in self.kept]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def make(self, value):
        return torch.full((BIG,), float(value))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_one(self, data):
        data.batch["x"] += 1
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


@pytest.fixture(scope="module")
def wg():
    podium.init()
    try:
        group = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Keeper))
        assert all(w.client.same_host for w in group.workers)
        yield group
        group.shutdown()
    finally:
        podium.shutdown()


def _segment_files(pids) -> list[str]:
    STAGE.close()  # free staged segments are kept (as files) for the next call
    return segments_of(*pids)


def test_arguments_a_worker_keeps_are_never_overwritten(wg):
    for value in (1.0, 2.0, 3.0):
        wg.keep(torch.full((BIG,), value))
    gc.collect()
    for kept in wg.kept_values():
        assert kept == [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)]


def test_results_the_controller_keeps_are_never_overwritten(wg):
    results = [wg.make(value) for value in (1.0, 2.0, 3.0, 4.0)]
    for value, per_rank in zip((1.0, 2.0, 3.0, 4.0), results):
        for tensor in per_rank:
            assert tensor.shape == (BIG,) and float(tensor.min()) == float(tensor.max()) == value


def test_a_steady_loop_reuses_a_few_segments_and_leaves_no_file(wg):
    data = DataProto.from_dict(tensors={"x": torch.zeros(64, BIG // 16)})
    sent_before = [w.client.stats["shm_sent"] for w in wg.workers]
    kept = [w.client.segments.pool.busy for w in wg.workers]  # arguments the workers keep
    staged_kept = STAGE.in_use
    for step in range(12):
        out = wg.add_one(data)
        assert float(out.batch["x"].min()) == float(out.batch["x"].max()) == 1.0, step
        del out
        gc.collect()
        # A worker gives an argument's segment back in a frame of its own, sent once its
        # input is gone, which is after the reply: wait for it, as a loop that does any
        # work between steps would, or the next step's arguments take a fresh segment
        # (collect() is ~1 ms with the controller's import heap frozen).
        eventually(lambda: [w.client.segments.pool.busy for w in wg.workers] == kept
                   and STAGE.in_use == staged_kept,
                   f"the workers to give step {step}'s argument segments back", timeout=30, interval=0.002)
    # Both ranks' shards went into one staged segment per call (shmstage), reused.
    assert [w.client.stats["shm_sent"] - s for w, s in zip(wg.workers, sent_before)] == [0, 0]
    assert STAGE.in_use == staged_kept and STAGE.segments <= staged_kept + 2  # not one per call
    for w in wg.workers:
        assert w.client.segments.pool.segments <= 4
    assert float(data.batch["x"].max()) == 0.0  # the controller's own batch is untouched
    pids = wg.pid() + [os.getpid()]
    assert _segment_files(pids) == []  # every segment was mapped and unlinked


class Adder:
    """Hosted directly by an in-process worker host (no WorkerGroup)."""

    def add(self, tensor, value):
        return tensor + value


@pytest.mark.parametrize("raw", [True, False], ids=["raw-socket", "grpc-stream"])
def test_segments_go_back_and_forth_on_both_call_transports(raw, token, arun, monkeypatch):
    """The bookkeeping frames (call id 0) travel on the raw socket and on the gRPC Calls
    stream (what TLS uses) alike: results kept by the caller stay intact, segments are reused."""
    from podium.worker.caller.client import WorkerClient
    from podium.worker.host.process import start_host

    if not raw:
        monkeypatch.setenv("PODIUM_RAW_CALLS", "0")

    async def scenario():
        host = await start_host("127.0.0.1", token=token, env={"RANK": "0", "WORLD_SIZE": "1"})
        client = WorkerClient(host.address, token)
        try:
            await client.start()
            assert client.same_host and (client.transport == "socket") == raw
            await client.construct((Adder, (), {}))
            base = torch.zeros(BIG)
            kept = [await client.call("add", (base, float(i))) for i in range(3)]
            for step in range(8):
                out = await client.call("add", (base, 100.0))
                assert float(out.min()) == float(out.max()) == 100.0, step
                del out
                gc.collect()
                await asyncio.sleep(0.02)  # the "released" frames cross the stream
            assert [(float(t.min()), float(t.max())) for t in kept] == [(0.0, 0.0), (1.0, 1.0), (2.0, 2.0)]
            assert client.stats["shm_sent"] == 11 and client.stats["shm_received"] == 11
            assert client.segments.pool.segments <= 4  # arguments: reused, not one per call
            assert len(client.segments.cache) <= 5  # results: 3 kept + the worker's reused ones
        finally:
            await client.close()
            await host.stop(grace=0.2)
        assert _segment_files([os.getpid()]) == []

    arun(scenario())
