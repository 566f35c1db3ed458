"""The carrier contract, run over every carrier: the chain (TCP and shared memory), the
collective (gloo here; NCCL where two GPUs are), and refs. Each case drives the ends through
the one driver (podium.rollout.weights.driver) and the endpoints roles compose, in threads of
one process: every pair arrives bit for bit, update after update; a failed update hands
nothing over and the next one goes through; a replica expecting another step refuses the
update; bad input is a typed error."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
import torch

from podium.errors import InvalidArgumentError, UnavailableError, WeightBroadcastError
from podium.rollout.weights.driver import Replicas, Source, drive_update
from podium.rollout.weights.endpoint import WeightEndpoint, WeightOutlet

pytestmark = pytest.mark.timeout(120)

TWO_GPUS = torch.cuda.device_count() >= 2
CARRIERS = ["chain", "gloo", "refs",
            pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(
                not TWO_GPUS, reason="NCCL needs two CUDA GPUs (one per rank)")])]
REPLICAS = 2
TIMEOUT = 5.0


def _state(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"f32": torch.randn(300, 7, generator=gen), "bf16": torch.randn(33, generator=gen).to(torch.bfloat16),
            "i64": torch.arange(1001) * step, "flag": torch.tensor([True, False, step % 2 == 0]),
            "strided": torch.randn(40, 30, generator=gen).t()}


class _Pending:
    """A receive running on a thread, waited for the way the driver waits for a Podium call."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    def get(self, timeout: float) -> dict:
        return self.future.result(timeout)


class Rig:
    """One trainer outlet and REPLICAS endpoints of one carrier, driven in-process."""

    def __init__(self, carrier: str) -> None:
        self.carrier = carrier
        self.weights: Any = {}  # a state dict, or an iterator of pairs
        self.outlet = WeightOutlet(lambda: self.weights.items() if isinstance(self.weights, dict) else self.weights)
        self.loaded: list[dict] = [{} for _ in range(REPLICAS)]
        self.endpoints = [WeightEndpoint(f"r{i}", self._loader(i)) for i in range(REPLICAS)]
        self.pool = concurrent.futures.ThreadPoolExecutor(REPLICAS)
        self.steps: list[int | None] | None = None  # the step each replica expects (default: the update's)

    def _loader(self, i: int):
        def load(pairs):  # copied out at once: a carrier may reuse its buffers next update
            self.loaded[i] = {name: tensor.cpu().clone() for name, tensor in pairs}
        return load

    def update(self, weights, step: int | None):
        self.weights = weights
        steps = self.steps or [step] * REPLICAS
        replicas = Replicas(
            prepare=lambda kind, t: [e.prepare(kind, t) for e in self.endpoints],
            receive=lambda kind, routes, _: [_Pending(self.pool.submit(e.receive, r, s, kind))
                                             for e, r, s in zip(self.endpoints, routes, steps)])
        source = Source(send=lambda kind, route, s: self.outlet.send(route, s, kind, 4 << 10, TIMEOUT),
                        prepare=lambda kind, receivers: self.outlet.prepare(receivers, kind, 4 << 10, TIMEOUT))
        try:
            return drive_update(self.carrier, replicas, source, step, TIMEOUT).conclude()
        finally:
            for e in self.endpoints:
                e.finalize()

    def close(self) -> None:
        self.outlet.close()
        self.pool.shutdown(wait=True)


@pytest.fixture(params=CARRIERS)
def rig(request):
    rig = Rig(request.param)
    yield rig
    rig.close()


def _assert_holds(rig: Rig, state: dict) -> None:
    for loaded in rig.loaded:
        assert list(loaded) == list(state)
        for name, tensor in state.items():
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_every_pair_arrives_exactly_update_after_update(rig):
    for step in (1, 2, 3):
        summary = rig.update(_state(step), step)
        assert summary["tensors"] == 5 and summary["buckets"] >= 3 and summary["replicas"] == REPLICAS
        _assert_holds(rig, _state(step))


def _failing(state: dict):
    # Several buckets go out, then the trainer's weights fail (a gather that broke).
    items = list(state.items())
    yield from items[:3]
    raise UnavailableError("the trainer lost a shard")


def test_a_failed_update_hands_nothing_over_and_the_next_goes_through(rig):
    rig.update(_state(1), 1)
    with pytest.raises(WeightBroadcastError) as info:
        rig.update(_failing(_state(2)), 2)
    assert info.value.updated == [] and sorted(info.value.kept) == ["r0", "r1"]
    for name, out in info.value.failed.items():
        assert out, name
    _assert_holds(rig, _state(1))  # the previous weights, untouched
    rig.update(_state(3), 3)
    _assert_holds(rig, _state(3))


def test_a_replica_expecting_another_step_refuses_the_update(rig):
    rig.update(_state(1), 1)
    rig.steps = [2, 2]  # the replicas wait for step 2; the trainer sends step 3
    with pytest.raises(WeightBroadcastError) as info:
        rig.update(_state(3), 3)
    assert "r0" in info.value.failed and "r0" in info.value.kept
    _assert_holds(rig, _state(1))


def test_bad_pairs_are_a_typed_error_and_nothing_is_handed_over(rig):
    rig.update(_state(1), 1)
    with pytest.raises(WeightBroadcastError) as info:
        rig.update({"w": [1.0, 2.0]}, 2)  # not a tensor
    assert sorted(info.value.kept) == ["r0", "r1"]
    _assert_holds(rig, _state(1))


def test_an_unknown_carrier_is_refused():
    rig = Rig("pigeon")
    try:
        with pytest.raises(InvalidArgumentError, match="carrier"):
            rig.update(_state(1), 1)
    finally:
        rig.close()
