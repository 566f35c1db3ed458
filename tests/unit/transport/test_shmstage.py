"""podium.transport.shmstage: one segment for a group call's payloads, laid out as the
caller's memory, with references per payload; and its lifetimes (pins, holders, views)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from podium import codec
from podium.errors import DataLossError
from podium.memorypool import move
from podium.transport import shm, shmsegment
from podium.transport.payload import Payload
from podium.transport.shmstage import StagePool

MIN = 1 << 16


class Link:
    """Stands for a connection's SharedSegments: records what it is told to forget."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def forget_foreign(self, names) -> None:
        self.forgotten.extend(names)


@pytest.fixture
def stages():
    pool = StagePool()
    yield pool
    pool.close()


def _views(stage_pool, payload):
    staged = payload.staged
    refs = staged.refs
    return {refs[i]: stage_pool.view(staged.name, refs[i + 1], refs[i + 2]) for i in range(0, len(refs), 3)}


def _decode(stage_pool, payload):
    return codec.decode(b"".join(payload.staged.rest.to_segments()), _views(stage_pool, payload))


def test_shards_of_one_tensor_lie_one_after_another_and_decode_bit_exact(stages):
    batch = torch.randn(64, 4096)
    ids = torch.arange(64 * 1024, dtype=torch.int64).view(64, 1024)
    payloads = [Payload(codec.encode(((x, i), {}))) for x, i in zip(batch.chunk(4), ids.chunk(4))]
    name = stages.stage(payloads, MIN)
    assert name is not None
    offsets = {}
    for rank, payload in enumerate(payloads):
        assert payload.staged.name == name and payload.staged.nbytes < 4096
        refs = payload.staged.refs
        offsets[rank] = [refs[i + 1] for i in range(0, len(refs), 3)]
        (x, i), _ = _decode(stages, payload)
        assert torch.equal(x, batch.chunk(4)[rank]) and torch.equal(i, ids.chunk(4)[rank])
    shard = batch.chunk(4)[0].nbytes
    assert [offsets[r][0] - offsets[0][0] for r in range(4)] == [r * shard for r in range(4)]  # adjacent
    assert stages.segments == 1


def test_a_buffer_every_payload_shares_is_copied_once(stages):
    tensor = torch.ones(1 << 18)
    payload = Payload(codec.encode(((tensor,), {})))
    other = Payload(codec.encode(((tensor,), {})))
    stages.stage([payload, other], MIN)
    assert payload.staged.refs[1:] == other.staged.refs[1:]  # the same bytes of the segment


def test_alignment_within_a_cache_line_is_kept_for_odd_slices(stages):
    raw = torch.arange(1 << 20, dtype=torch.uint8)
    odd = raw[3:]  # starts at an odd address
    payload = Payload(codec.encode(((odd,), {})))
    stages.stage([payload], MIN)
    assert payload.staged.refs[1] % 64 == odd.data_ptr() % 64
    (got,), _ = _decode(stages, payload)
    assert torch.equal(got, odd)


def test_small_buffers_stay_in_the_payload(stages):
    payload = Payload(codec.encode(((torch.ones(100), np.zeros(10)), {})))
    assert stages.stage([payload], MIN) is None and payload.staged is None


def test_a_segment_is_reused_only_when_no_pin_holder_or_view_is_left(stages):
    link = Link()
    payload = Payload(codec.encode(((torch.ones(1 << 18),), {})))
    name = stages.stage([payload], MIN)
    stages.sent(name, link)  # a rank's call
    stages.unpin(name)  # the group call's own pin
    views = _views(stages, payload)
    stages.unpin(name)  # the rank's reply decoded (into views)
    assert stages.release(name, link)  # the worker let go
    again = Payload(codec.encode(((torch.zeros(1 << 18),), {})))
    assert stages.stage([again], MIN) != name  # still viewed here
    del views
    gc.collect()
    stages.unpin(again.staged.name)
    assert stages.in_use == 0
    third = Payload(codec.encode(((torch.zeros(1 << 18),), {})))
    assert stages.stage([third], MIN) in (name, again.staged.name)  # reused
    stages.unpin(third.staged.name)


def test_a_closed_connection_holds_nothing(stages):
    link = Link()
    payload = Payload(codec.encode(((torch.ones(1 << 18),), {})))
    name = stages.stage([payload], MIN)
    stages.sent(name, link)
    stages.unpin(name)
    stages.unpin(name)
    assert stages.in_use == 1  # the worker has not released it
    stages.link_closed(link)
    assert stages.in_use == 0


def test_an_abandoned_segment_is_never_reused_and_its_file_goes_at_once(stages):
    link, other = Link(), Link()
    payload = Payload(codec.encode(((torch.ones(1 << 18),), {})))
    name = stages.stage([payload], MIN)
    stages.sent(name, link)
    stages.sent(name, other)
    stages.unpin(name)
    assert os.path.exists(os.path.join(shm.SHM_DIR, name))
    stages.abandon(name, link)  # that rank's call failed
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))
    assert link.forgotten == [name] and other.forgotten == [name]
    view = stages.view(name, payload.staged.refs[1], 16)  # the other rank's reply still reads it
    with pytest.raises(DataLossError, match="dropped"):
        stages.sent(name, Link())
    del view
    stages.unpin(name)
    stages.release(name, other)
    assert stages.in_use == 0 and stages.segments == 0


def test_references_outside_the_segment_or_to_another_are_data_loss(stages):
    payload = Payload(codec.encode(((torch.ones(1 << 18),), {})))
    name = stages.stage([payload], MIN)
    with pytest.raises(DataLossError, match="bytes"):
        stages.view(name, 1 << 40, 8)
    with pytest.raises(DataLossError, match="not lent"):
        stages.view("podium-1-other", 0, 8)
    stages.unpin(name)


def test_no_room_in_the_budget_stages_nothing(stages, monkeypatch):
    monkeypatch.setattr(shmsegment.budget, "limit", shmsegment.budget.used)
    payload = Payload(codec.encode(((torch.ones(1 << 18),), {})))
    assert stages.stage([payload], MIN) is None and payload.staged is None


@pytest.mark.parametrize("sizes", [[40 << 20], [1, 3 << 20, 20 << 20, 7], [9 << 20, 9 << 20]])
def test_a_large_move_split_between_two_threads_copies_every_byte(sizes):
    sources = [np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8) for n in sizes]
    dest = np.zeros(sum(sizes), dtype=np.uint8)
    at, moves = 0, []
    for src in sources:
        moves.append((dest.ctypes.data + at, src.ctypes.data, src.nbytes))
        at += src.nbytes
    move(moves)
    assert np.array_equal(dest, np.concatenate(sources))


def test_rows_that_came_back_adjacent_in_a_staged_segment_concatenate_into_a_view_of_it():
    # The transport registers the process's staged segments with layer 1 (podium.spans), so
    # rowcat, which never imports the transport, finds them.
    from podium import rowcat
    from podium.transport.shmstage import STAGE

    batch = torch.randn(4, 1 << 17)  # 2 MiB: pooled size
    payloads = [Payload(codec.encode(((shard,), {}))) for shard in batch.chunk(2)]
    name = STAGE.stage(payloads, MIN)
    try:
        shards = [_decode(STAGE, payload)[0][0] for payload in payloads]
        out = rowcat.cat_rows(shards)
        assert out.data_ptr() == shards[0].data_ptr()  # a view of the segment, no copy
        assert torch.equal(out, batch)
        apart = rowcat.cat_rows([shards[1], shards[0]])  # not in order: copied
        assert apart.data_ptr() != shards[1].data_ptr() and torch.equal(apart, torch.cat([shards[1], shards[0]]))
    finally:
        STAGE.unpin(name)


def test_the_transport_fills_the_hook_without_importing_torch():
    # Staged segments register with podium.spans when the transport is imported; that must
    # not load torch into a worker that never uses it (cold start).
    code = ("import sys\n"
            "import numpy as np\n"
            "from podium import codec, spans\n"
            "from podium.transport import shmsegment\n"
            "from podium.transport.connection import CallConnection\n"
            "from podium.transport.payload import Payload\n"
            "from podium.transport.shmstage import STAGE\n"
            "payload = Payload(codec.encode(np.ones(1 << 18)))\n"
            "name = STAGE.stage([payload], 1 << 16)\n"
            "index, offset, length = payload.staged.refs\n"
            "view = STAGE.view(name, offset, length)\n"
            "found = spans.find(shmsegment.address_of(view), length)\n"
            "print(found is not None and shmsegment.address_of(found) == shmsegment.address_of(view),\n"
            "      spans.find(1, 8), sorted(m for m in ('torch', 'tensordict') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "None", "[]"]
