"""Calls made while an actor's constructor runs wait in the controller, each with a copy of its
arguments (issue #48): their count and bytes are bounded, and the call past a bound fails at
once with a ResourceExhaustedError that names the bounds, while those queued before run.
The bounds are lowered here (monkeypatch) so the test sits at them without a GiB of data."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch

import podium
from podium import limits
from podium.errors import ResourceExhaustedError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster():
    podium.init(num_cpus=4, num_gpus=0)
    try:
        yield
    finally:
        podium.shutdown()


@podium.remote(num_cpus=1)
class Slow:
    """Its constructor waits until a file appears (so the test decides when it ends)."""

    def __init__(self, flag: str) -> None:
        deadline = time.monotonic() + 120
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.02)

    def size(self, tensor) -> int:
        return int(tensor.numel())


@pytest.mark.parametrize("bound", ["count", "bytes"])
def test_calls_behind_a_constructor_are_bounded(cluster, monkeypatch, bound):
    monkeypatch.setattr(limits, "MAX_QUEUED_CALLS", 4 if bound == "count" else 1000, raising=False)
    monkeypatch.setattr(limits, "MAX_QUEUED_BYTES", (4 << 20) + (64 << 10) if bound == "bytes" else 1 << 30,
                        raising=False)
    flag = os.path.join(tempfile.mkdtemp(), "go")
    actor = Slow.remote(flag)
    arg = torch.zeros(1 << 18)  # 1 MiB
    refs = [actor.size.remote(arg) for _ in range(4)]  # at the bound
    with pytest.raises(ResourceExhaustedError, match="wait for the actor's constructor") as caught:
        actor.size.remote(arg)
    assert "4 calls" in str(caught.value)
    open(flag, "w").close()
    assert podium.get(refs, timeout=120) == [1 << 18] * 4
    assert podium.get(actor.size.remote(arg), timeout=60) == 1 << 18  # once constructed: no queue
