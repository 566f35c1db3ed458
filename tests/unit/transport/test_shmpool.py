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
from podium.transport import shmpool, shmsegment
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
    monkeypatch.setattr(shmsegment.budget, "limit", shmsegment.budget.used + (3 << 20))
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


# ------------------------------------------------------------ replies written in place


def _in_place_reply(link, value):
    """What a worker does with an argument it changed in place: locate its buffers in the
    argument's segment, and send the rest with references (see SyncInvoker.package)."""
    name, nbytes = link.send(((value,), {}))
    (arg,), _ = link.receive(name, nbytes)
    arg += 1
    encoded = codec.encode(arg)
    found = link.cache.locate(name, encoded.buffers, 1 << 16)
    rest = codec.without_buffers(encoded, set(found))
    return name, arg, found, rest


def test_a_pinned_segment_released_by_the_peer_is_not_reused_until_unpinned(link):
    encoded = codec.encode(torch.ones(1 << 18))
    name = link.pool.write(encoded.to_segments(), encoded.nbytes, pin=True)
    link.receive(name, encoded.nbytes)
    gc.collect()
    link.deliver()  # the peer released it: a reply that views it may still be on its way
    second = link.pool.write(encoded.to_segments(), encoded.nbytes)
    assert second != name
    link.pool.unpin(name)
    link.receive(second, encoded.nbytes)
    gc.collect()
    link.deliver()
    assert link.pool.busy == 0 and link.pool.segments == 2


def test_a_reply_in_place_is_located_and_decoded_as_views_of_the_callers_segment(link):
    name, arg, found, rest = _in_place_reply(link, torch.arange(1 << 18, dtype=torch.float32))
    assert list(found) == [0] and found[0][1] == (1 << 18) * 4
    assert rest.nbytes < 4096  # the data is not in the reply
    del arg
    gc.collect()
    assert not link.cache.leased(name) and link.released == [name]
    link.deliver()
    # Sent without a pin, the segment went back to the free list with the release: a reply
    # that refers to it now is refused rather than read from memory that may be reused.
    with pytest.raises(DataLossError, match="not lent"):
        link.pool.view(name, *found[0])


def test_views_of_a_reply_keep_the_segment_from_reuse_until_they_die(link):
    encoded = codec.encode(((torch.zeros(1 << 18),), {}))
    name = link.pool.write(encoded.to_segments(), encoded.nbytes, pin=True)
    (arg,), _ = link.receive(name, encoded.nbytes)
    arg += 3
    found = link.cache.locate(name, codec.encode(arg).buffers, 1 << 16)
    rest = codec.without_buffers(codec.encode(arg), set(found))
    del arg
    gc.collect()
    link.deliver()  # released first, as the worker's frames arrive, then the reply
    views = {i: link.pool.view(name, offset, length) for i, (offset, length) in found.items()}
    link.pool.unpin(name)
    result = codec.decode(b"".join(rest.to_segments()), views)
    del views
    assert torch.equal(result, torch.full((1 << 18,), 3.0))
    again = link.pool.write(encoded.to_segments(), encoded.nbytes)
    assert again != name  # the result still views it
    assert torch.equal(result, torch.full((1 << 18,), 3.0))
    del result
    gc.collect()
    assert link.pool.busy == 1  # only `again`, in the peer's hands


def test_a_view_outside_the_segment_or_of_a_segment_not_lent_is_data_loss(link):
    encoded = codec.encode(torch.zeros(1 << 18))
    name = link.pool.write(encoded.to_segments(), encoded.nbytes, pin=True)
    with pytest.raises(DataLossError, match="bytes"):
        link.pool.view(name, 1 << 30, 16)
    with pytest.raises(DataLossError, match="not lent"):
        link.pool.view("podium-1-nosuch", 0, 16)
    link.pool.unpin(name)


def test_a_kept_argument_is_still_leased_and_its_bytes_can_be_copied(link):
    name, arg, found, rest = _in_place_reply(link, torch.zeros(1 << 18))
    assert link.cache.leased(name)  # the "worker" keeps arg
    copy = bytes(link.cache.peek(name, *found[0]))
    assert copy == bytes(arg.numpy().tobytes())
