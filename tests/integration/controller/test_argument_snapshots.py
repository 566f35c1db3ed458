"""An argument is what it was when the call returned.

A call that returns before its arguments are sent (a ``blocking=False`` method, a task, an
actor method) or before a value is stored (``put``) must not see what the caller does to
those arguments afterwards: Ray serializes them at call time, and a verl loop that reuses or
edits a batch after a non-blocking call relies on that. Each case changes its tensors in
place right after the call returns, on every path a payload takes: shared memory (the
embedded cluster is on this host), TCP (``PODIUM_DISABLE_SHM``), TCP under mutual TLS and the
gRPC stream (``PODIUM_RAW_CALLS=0``).
"""

from __future__ import annotations

import gc
import os
import signal

import pytest
import torch

import podium
from podium import DataProto
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.worker import Dispatch, Worker, register
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(240)

#: 32 MiB of float32 ones: a sum of ones is exact, and +1 in place doubles it.
NUMEL = 8 << 20
PATHS = {
    "shm": {},
    "tcp": {"PODIUM_DISABLE_SHM": "1"},
    "tls": {"PODIUM_DISABLE_SHM": "1"},
    "grpc": {"PODIUM_DISABLE_SHM": "1", "PODIUM_RAW_CALLS": "0"},
}


class Summer(Worker):
    """Sums what it is given."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def total(self, tensor):
        return float(tensor.double().sum())

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def totals(self, data):
        return DataProto.from_dict({"s": data.batch["x"].double().sum(dim=1, keepdim=True)})


@podium.remote
def task_total(tensor):
    return float(tensor.double().sum())


@podium.remote
class ActorSummer:
    def total(self, tensor):
        return float(tensor.double().sum())


@pytest.fixture(scope="module", params=sorted(PATHS))
def path(request, tmp_path_factory):
    saved = {k: os.environ.get(k) for k in PATHS[request.param]}
    os.environ.update(PATHS[request.param])
    if request.param == "tls":
        from tests.support.certs import make_tls
        podium.init(tls=make_tls(str(tmp_path_factory.mktemp("tls"))))
    else:
        podium.init()
    try:
        yield request.param
    finally:
        podium.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def group(path):
    wg = WorkerGroup(ResourcePool([2], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Summer),
                     name_prefix=f"snap{path}")
    expected = {"shm": True, "tcp": False, "tls": False, "grpc": False}[path]
    assert [w.client.same_host for w in wg.workers] == [expected] * 2
    assert {w.client.transport for w in wg.workers} == {"grpc" if path == "grpc" else "socket"}
    yield wg
    wg.shutdown()


def test_a_non_blocking_method_gets_the_argument_as_it_was(group):
    tensor = torch.ones(NUMEL)
    refs = group.total(tensor)
    tensor += 1
    assert podium.get(refs, timeout=120) == [float(NUMEL)] * 2


def test_a_non_blocking_dp_compute_proto_gets_the_batch_as_it_was(group):
    data = DataProto.from_dict({"x": torch.ones(64, NUMEL // 64)})
    future = group.totals(data)
    data.batch["x"] += 1
    out = future.get(timeout=120)
    assert torch.equal(out.batch["s"], torch.full((64, 1), float(NUMEL // 64), dtype=torch.float64))


def test_a_batch_for_stopped_workers_is_what_it_was_when_the_call_returned(group, path, monkeypatch):
    """The workers read nothing while the call is made (SIGSTOP): over TCP the send stalls
    once the socket buffers are full, and the rest is copied before the call returns."""
    from podium.transport.copyonsend import CopyOnSend
    made: list[CopyOnSend] = []
    run = CopyOnSend.run
    monkeypatch.setattr(CopyOnSend, "run", lambda self: (run(self), made.append(self))[0])
    data = DataProto.from_dict({"x": torch.ones(64, 4 * NUMEL // 64)})  # 64 MiB per rank
    pids = [w.pid for w in group.workers]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        future = group.totals(data)
        data.batch["x"] += 1
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    out = future.get(timeout=120)
    assert torch.equal(out.batch["s"], torch.full((64, 1), float(4 * NUMEL // 64), dtype=torch.float64))
    # TCP: each rank's chunk was copied while it was sent, and not all of it went out.
    assert len(made) == (2 if path == "tcp" else 0)
    assert all(0 <= cos.sent_directly < cos.total for cos in made)


def test_a_task_gets_the_argument_as_it_was(group):
    tensor = torch.ones(NUMEL)
    ref = task_total.remote(tensor)
    tensor += 1
    assert podium.get(ref, timeout=120) == float(NUMEL)


def test_an_actor_method_gets_the_argument_as_it_was(group):
    actor = ActorSummer.remote()
    tensor = torch.ones(NUMEL)
    ref = actor.total.remote(tensor)
    tensor += 1
    assert podium.get(ref, timeout=120) == float(NUMEL)
    podium.kill(actor)


def test_put_stores_the_value_as_it_was(group):
    tensor = torch.ones(NUMEL)
    ref = podium.put(tensor)
    tensor += 1
    assert float(podium.get(ref, timeout=120).double().sum()) == float(NUMEL)
    assert podium.get(group.total(ref), timeout=120) == [float(NUMEL)] * 2  # read by the workers


def test_a_snapshot_is_the_segment_on_shared_memory_a_copy_elsewhere_and_one_never_sent_is_dropped(group, path):
    from podium.worker.caller.client import prepare
    client = group.workers[0].client
    if path != "shm":  # TCP and gRPC: a copy in memory of its own, not the tensor's
        tensor = torch.ones(NUMEL)
        payload = client.snapshot(prepare(((tensor,), {})))
        assert payload.written is None and payload.encoded.buffers
        # TCP copies while it sends (the caller runs the copy once the call is queued); with
        # no send under way the whole payload is copied.
        assert (payload.copying is not None) == (path == "tcp")
        if payload.copying is not None:
            payload.copying.run()
            assert payload.copying.sent_directly == 0
        tensor += 1
        assert all(bytes(buf[:4]) == torch.ones(1).numpy().tobytes() for buf in payload.encoded.buffers)
        return
    pool = client._conn.segments.pool
    before = pool.busy
    tensor = torch.ones(NUMEL)
    payload = client.snapshot(prepare(((tensor,), {})))
    # Written into the worker's segment as the call returns: no copy of its own besides.
    assert payload.written is not None and not payload.encoded.buffers
    assert pool.busy == before + 1
    tensor += 1  # changes nothing in the segment; a new call sends the new values
    del payload  # its call never went out: the segment goes back, not to the peer
    gc.collect()
    eventually(lambda: pool.busy == before, "the unsent snapshot's segment to be dropped")
    assert podium.get(group.total(tensor), timeout=120) == [2.0 * NUMEL] * 2
