"""Weight broadcast over worker groups: a trainer rank to three replica processes along a
chain, updates that reuse the replicas' buffers, and a replica SIGKILLed mid-update."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.worker import Dispatch, Worker, register

from podium.errors import WeightBroadcastError
from podium.rollout.broadcastgroups import (
    BroadcastSource,
    BroadcastTarget,
    broadcast_weights,
)
from tests.support.clusters import controller_cluster

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

#: Parameter shapes: several buckets at 64 KiB, one tensor bigger than a bucket.
SHAPES = {"embed": (64, 32), "layer.w": (128, 128), "layer.b": (128,), "head": (40, 64)}
GATE_SECONDS = 60


def _model(fill: float) -> dict[str, torch.Tensor]:
    return {name: torch.full(shape, fill) + torch.arange(torch.Size(shape).numel()).reshape(shape)
            for name, shape in SHAPES.items()}


class Trainer(BroadcastSource, Worker):
    """Holds a model whose values the test sets; can pause between its tensors."""

    def __init__(self):
        super().__init__()
        self.state = _model(0.0)
        self.gate: tuple[str, str] | None = None

    def rollout_state_dict(self):
        """The model the broadcast sends."""
        return self.state

    def broadcast_weights_iter(self):
        """The state, pausing before the last tensor until a gate file exists (when set)."""
        items = list(self.state.items())
        for i, pair in enumerate(items):
            if self.gate and i == len(items) - 1:
                waiting, gate = self.gate
                open(waiting, "w").close()
                deadline = time.monotonic() + GATE_SECONDS
                while not os.path.exists(gate) and time.monotonic() < deadline:
                    time.sleep(0.01)
            yield pair

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_fill(self, fill: float, gate: tuple[str, str] | None = None) -> None:
        """New weights: every tensor shifted to ``fill``; pause at ``gate`` when given."""
        self.state = _model(fill)
        self.gate = gate


class Replica(BroadcastTarget, Worker):
    """A rollout stand-in: a model of the same shapes, zeros at first."""

    def __init__(self):
        super().__init__()
        self.state = {name: torch.zeros(shape) for name, shape in SHAPES.items()}

    def rollout_state_dict(self):
        """The model the broadcast loads into."""
        return self.state

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fills(self) -> list[float]:
        """Each tensor's value at index 0 (its fill), in order."""
        return [float(t.reshape(-1)[0]) for t in self.state.values()]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def matches(self, fill: float) -> bool:
        """Whether every tensor equals the trainer's model at ``fill``."""
        return all(torch.equal(self.state[k], v) for k, v in _model(fill).items())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        """This replica's process id."""
        return os.getpid()


@pytest.fixture(scope="module", autouse=True)
def cluster(tmp_path_factory):
    with controller_cluster("embedded", tmp_path_factory.mktemp("embedded")):
        yield


@pytest.fixture
def groups():
    trainer = WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Trainer),
                          name_prefix="trainer")
    replicas = WorkerGroup(ResourcePool([3], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Replica),
                           name_prefix="replicas")
    try:
        yield trainer, replicas
    finally:
        trainer.shutdown()
        replicas.shutdown()


def test_every_replica_gets_the_whole_update_and_the_next_one(groups):
    trainer, replicas = groups
    total = sum(torch.Size(s).numel() * 4 for s in SHAPES.values())
    for step, fill in enumerate((5.0, -3.0)):
        trainer.set_fill(fill)
        result = broadcast_weights(trainer, replicas, step=step, bucket_bytes=64 << 10, timeout=30)
        assert result["tensors"] == len(SHAPES) and result["bytes"] == total
        assert result["buckets"] >= 2 and result["replicas"] == 3
        assert replicas.matches(fill) == [True, True, True]


def test_a_replica_killed_mid_update_is_named_and_the_others_stay_whole(groups, tmp_path):
    trainer, replicas = groups
    broadcast_weights(trainer, replicas, step=0, bucket_bytes=64 << 10, timeout=30)  # all at fill 0
    waiting, gate = str(tmp_path / "waiting"), str(tmp_path / "gate")
    trainer.set_fill(9.0, gate=(waiting, gate))
    victim = replicas.pid()[1]  # asked now: a replica answers once its receive ended
    outcome: list = []

    def update():
        try:
            outcome.append(broadcast_weights(trainer, replicas, step=1, bucket_bytes=64 << 10, timeout=10))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    thread = threading.Thread(target=update)
    thread.start()
    deadline = time.monotonic() + GATE_SECONDS
    while not os.path.exists(waiting):  # the first buckets have gone down the chain
        assert time.monotonic() < deadline, "the trainer never reached its gate"
        time.sleep(0.01)
    os.kill(victim, signal.SIGKILL)
    open(gate, "w").close()
    thread.join(120)
    assert not thread.is_alive()
    error = outcome[0]
    assert isinstance(error, WeightBroadcastError), error
    names = list(error.failed)
    assert any(f"pid {victim}" in name for name in names), error.failed
    assert len(error.updated) == 1 and "rank 0" in error.updated[0]
    assert len(error.kept) == 2 and f"pid {victim}" in " ".join(error.kept)
    assert f"pid {victim}" in str(error)
    # Rank 0 has the new model; rank 2, downstream of the dead one, kept the old one whole.
    assert replicas.workers[0].call("matches", 9.0)
    assert replicas.workers[2].call("matches", 0.0)


def test_the_collective_carrier_runs_through_the_same_driver(groups):
    # carrier="gloo" (what "nccl" falls back to without GPUs): the trainer opens the group's
    # rendezvous (broadcast_open), every replica joins it once and keeps it for the next update.
    trainer, replicas = groups
    for step, fill in enumerate((7.0, 2.0)):
        trainer.set_fill(fill)
        result = broadcast_weights(trainer, replicas, step=step, bucket_bytes=64 << 10, timeout=30, carrier="gloo")
        assert result["tensors"] == len(SHAPES) and result["replicas"] == 3
        assert replicas.matches(fill) == [True, True, True]
    trainer.set_fill(-1.0)  # the chain again, beside the group
    broadcast_weights(trainer, replicas, step=2, bucket_bytes=64 << 10, timeout=30)
    assert replicas.matches(-1.0) == [True, True, True]
