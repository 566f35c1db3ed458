"""podium.transport.shmpool: a writer's reusable segments and a reader's cache of them, wired together
in one process the way a call connection wires them between two."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

from podium import codec
from podium.transport import shm
from podium.transport import shmpool
from podium.errors import DataLossError


class Link:
    """A pool and a cache whose messages to each other are queued, as frames would be."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.forgotten: list[str] = []
        self.pool = shmpool.SegmentPool(self.forgotten.extend)
        self.cache = shmpool.SegmentCache(self.released.extend)

    def deliver(self) -> None:
        """Hand the queued messages over (what the peer does when a frame arrives)."""
        released, self.released[:] = list(self.released), []
        forgotten, self.forgotten[:] = list(self.forgotten), []
        self.pool.release(released)
        self.cache.forget(forgotten)

    def send(self, value):
        encoded = codec.encode(value)
        name = self.pool.write(encoded.to_segments(), encoded.nbytes)
        assert name is not None
        return name, encoded.nbytes

    def receive(self, name: str, nbytes: int):
        return codec.decode(self.cache.read(name, nbytes))

    def close(self) -> None:
        self.pool.close()
        self.cache.close()


@pytest.fixture
def link():
    link = Link()
    yield link
    link.close()


def _files(name: str) -> bool:
    return os.path.exists(os.path.join(shm.SHM_DIR, name))


def test_a_released_segment_is_written_again_and_its_file_is_gone(link):
    name, nbytes = link.send(torch.arange(1 << 18, dtype=torch.float32))
    assert _files(name)  # until the reader maps it
    got = link.receive(name, nbytes)
    assert not _files(name)  # the reader unlinked it: nothing can leak from now on
    assert torch.equal(got, torch.arange(1 << 18, dtype=torch.float32))
    assert link.released == []  # the value still views the segment
    del got
    gc.collect()
    assert link.released == [name]
    link.deliver()
    again, nbytes = link.send(torch.full((1 << 18,), 7.0))
    assert again == name and link.pool.segments == 1
    assert torch.equal(link.receive(again, nbytes), torch.full((1 << 18,), 7.0))


def test_a_segment_whose_value_is_alive_is_never_reused(link):
    first_name, nbytes = link.send(torch.ones(1 << 18))
    kept = link.receive(first_name, nbytes)
    second_name, nbytes = link.send(torch.full((1 << 18,), 2.0))
    assert second_name != first_name
    second = link.receive(second_name, nbytes)
    assert torch.equal(kept, torch.ones(1 << 18)) and torch.equal(second, torch.full((1 << 18,), 2.0))


def test_writes_are_zero_copy_views_the_reader_may_mutate(link):
    name, nbytes = link.send({"x": np.zeros(300_000, dtype=np.int64)})
    got = link.receive(name, nbytes)
    got["x"] += 5  # writable: verl workers mutate batches in place
    assert int(got["x"].sum()) == 1_500_000


def test_reusing_a_segment_still_in_use_is_refused(link):
    name, nbytes = link.send(torch.ones(1 << 18))
    kept = link.receive(name, nbytes)
    with pytest.raises(DataLossError, match="still in use"):
        link.cache.read(name, nbytes)
    del kept


def test_an_abandoned_segment_is_forgotten_on_both_sides(link):
    name, nbytes = link.send(torch.ones(1 << 18))
    kept = link.receive(name, nbytes)
    link.pool.abandon(name)  # the call failed: never write it again
    assert link.pool.segments == 0 and link.forgotten == [name]
    link.deliver()
    assert torch.equal(kept, torch.ones(1 << 18))  # the reader's view outlives the writer
    del kept
    gc.collect()
    assert link.released == [] and len(link.cache) == 0  # forgotten: not given back


def test_an_abandoned_segment_never_mapped_leaves_no_file(link):
    name, _ = link.send(torch.ones(1 << 18))
    link.pool.abandon(name)
    assert not _files(name)


def test_free_segments_beyond_the_pool_limit_are_forgotten(link):
    names = []
    values = []
    for i in range(4):
        name, nbytes = link.send(torch.full((1 << 18,), float(i)))
        names.append(name)
        values.append(link.receive(name, nbytes))
    values.clear()
    gc.collect()
    link.deliver()  # four free: two are kept, two forgotten (and unmapped by the reader)
    assert link.pool.segments == 2
    link.deliver()
    assert len(link.cache) == 2


def test_the_byte_budget_falls_back_to_none(link, monkeypatch):
    monkeypatch.setattr(shmpool._budget, "limit", shmpool._budget.used + (3 << 20))
    assert link.pool.write([b"x" * (4 << 20)], 4 << 20) is None
    name = link.pool.write([b"x" * (2 << 20)], 2 << 20)
    assert name is not None


def test_a_name_that_is_neither_cached_nor_on_disk_is_data_loss(link):
    with pytest.raises(DataLossError):
        link.cache.read(f"{shm.PREFIX}{os.getpid()}-0000", 10)


def test_close_removes_every_file_not_yet_mapped(link):
    names = [link.send(torch.ones(1 << 18))[0] for _ in range(3)]
    link.pool.close()
    assert not any(_files(n) for n in names)
    assert link.pool.write([b"x"], 1) is None  # a closed pool takes nothing
