"""The weight broadcast over a process group of its own (gloo here; NCCL on GPUs: tests/gpu):
a sender and three replicas in threads of one process, on Podium's key-checked store and gloo."""

from __future__ import annotations

import threading

import pytest
import torch

from podium.errors import InvalidArgumentError, UnavailableError
from podium.rollout.broadcastcollective import CollectiveReceiver, CollectiveSender

pytestmark = pytest.mark.timeout(120)


def _state(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"f32": torch.randn(300, 7, generator=gen), "bf16": torch.randn(33, generator=gen).to(torch.bfloat16),
            "i64": torch.arange(1001) * step, "flag": torch.tensor([True, False, step % 2 == 0]),
            "strided": torch.randn(40, 30, generator=gen).t()}


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []

    def run():
        try:
            out.append(fn(*args))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _replica(receiver: CollectiveReceiver, meta: dict, rank: int, steps: list[int]) -> list:
    receiver.join(meta, rank)
    # Each update copied out at once, as a replica loads it before taking the next one.
    return [{name: tensor.clone() for name, tensor in receiver.receive(step)} for step in steps]


def test_three_replicas_get_every_update_exactly_over_one_group():
    sender = CollectiveSender(replicas=3, bucket_bytes=4 << 10, timeout=30, backend="gloo")
    meta = sender.prepare()
    receivers = [CollectiveReceiver(name=f"r{i}", timeout=30) for i in range(3)]
    threads = [_in_thread(_replica, r, meta, i + 1, [1, 2]) for i, r in enumerate(receivers)]
    try:
        for step in (1, 2):  # the second update reuses the group
            sent = sender.send(_state(step).items(), step)
            assert sent["tensors"] == 5 and sent["buckets"] >= 3
        for thread, out in threads:
            thread.join(30)
            updates = out[0]
            for step, got in zip((1, 2), updates):
                state = _state(step)
                assert list(got) == list(state)
                for name, tensor in state.items():
                    assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    finally:
        sender.close()


def test_a_sender_gone_mid_update_fails_the_replicas_and_hands_over_nothing():
    sender = CollectiveSender(replicas=1, bucket_bytes=4 << 10, timeout=5, backend="gloo")
    receiver = CollectiveReceiver(name="r", timeout=5)
    thread, out = _in_thread(_replica, receiver, sender.prepare(), 1, [1, 2])
    assert sender.send(_state(1).items(), 1)["tensors"] == 5  # joined, and one update through
    sender.close()  # update 2 never comes: the replica fails within its timeout
    thread.join(30)
    assert isinstance(out[0], UnavailableError) and "replica r" in str(out[0]), out


def test_arguments_are_checked():
    with pytest.raises(InvalidArgumentError):
        CollectiveSender(replicas=0)
    with pytest.raises(InvalidArgumentError):
        CollectiveSender(replicas=1, backend="mpi")
    with pytest.raises(InvalidArgumentError):
        CollectiveSender(replicas=1).send([("w", torch.ones(1))])  # send before prepare
    with pytest.raises(InvalidArgumentError):
        CollectiveReceiver().join({"host": "127.0.0.1"}, 1)
    with pytest.raises(InvalidArgumentError):
        CollectiveReceiver().join({"host": "127.0.0.1", "port": 1, "token": "t", "world_size": 2,
                                   "backend": "gloo"}, 2)  # rank outside the group
    with pytest.raises(InvalidArgumentError):
        CollectiveReceiver().receive()
