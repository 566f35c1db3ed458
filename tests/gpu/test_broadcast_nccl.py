"""The weight broadcast over NCCL on real GPUs: a sender on cuda:0 and a replica on cuda:1,
each in a process of its own (NCCL needs a device per rank), tensors staying on the device."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

REPLICA = textwrap.dedent("""
    import json, sys, torch
    from podium.rollout.broadcastcollective import CollectiveReceiver
    torch.cuda.set_device(1)
    receiver = CollectiveReceiver(name="gpu1", timeout=60)
    receiver.join(json.loads(sys.argv[1]), 1)
    got = dict(receiver.receive(7))
    assert all(t.device.type == "cuda" for t in got.values())
    print(json.dumps({k: float(t.float().sum()) for k, t in got.items()}))
""")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL broadcast needs two GPUs (one per rank)")
def test_nccl_moves_each_bucket_device_to_device():
    import json

    from podium.rollout.broadcastcollective import CollectiveSender

    torch.cuda.set_device(0)
    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.arange(4096, device="cuda").to(torch.bfloat16)}
    sender = CollectiveSender(replicas=1, bucket_bytes=1 << 20, timeout=60, backend="nccl")
    meta = sender.prepare()
    assert meta["backend"] == "nccl"
    replica = subprocess.Popen([sys.executable, "-c", REPLICA, json.dumps(meta)], stdout=subprocess.PIPE, text=True)
    try:
        sender.send(state.items(), 7)
        out, _ = replica.communicate(timeout=120)
        assert replica.returncode == 0
        sums = json.loads(out)
        for name, tensor in state.items():
            assert sums[name] == pytest.approx(float(tensor.float().sum()), rel=1e-5)
    finally:
        sender.close()
        if replica.poll() is None:
            replica.kill()
