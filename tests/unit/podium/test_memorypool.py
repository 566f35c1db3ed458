"""podium.memorypool: reused mappings, leases that give them back, a bounded free list."""

from __future__ import annotations

import gc

import numpy as np

from podium.memorypool import MemoryPool


def test_a_returned_mapping_is_reused_for_the_same_size():
    pool = MemoryPool(idle_limit=64 << 20)
    first = pool.take(3 << 20)
    pool.give_back(first)
    again = pool.take(3 << 20)
    assert again is first and (pool.created, pool.reused) == (1, 1)
    assert pool.idle_bytes == 0


def test_a_much_larger_free_mapping_is_not_used_for_a_small_payload():
    pool = MemoryPool(idle_limit=64 << 20)
    big = pool.take(16 << 20)
    pool.give_back(big)
    small = pool.take(1 << 20)
    assert small is not big and pool.created == 2
    assert pool.idle_bytes == len(big)


def test_a_lease_gives_its_mapping_back_when_the_last_view_dies():
    pool = MemoryPool(idle_limit=64 << 20)
    buffer = pool.take(2 << 20)
    view = pool.lease(buffer, 1000)
    assert len(view) == 1000 and not view.readonly
    array = np.frombuffer(view, dtype=np.uint8)  # a decoded value keeps the lease alive
    array[:] = 7
    del view
    gc.collect()
    assert pool.idle_bytes == 0  # still viewed by `array`
    del array
    gc.collect()
    assert pool.idle_bytes == len(buffer)
    assert pool.take(2 << 20) is buffer


def test_free_mappings_are_bounded_least_recently_returned_first():
    pool = MemoryPool(idle_limit=3 << 20)
    a, b, c = pool.take(1 << 20), pool.take(1 << 20), pool.take(2 << 20)
    for buffer in (a, b, c):
        pool.give_back(buffer)
    assert pool.idle_bytes == 3 << 20
    assert a.closed and not b.closed and not c.closed


def test_sizes_are_rounded_so_a_slightly_larger_payload_reuses_the_mapping():
    pool = MemoryPool(idle_limit=64 << 20)
    buffer = pool.take((4 << 20) - 5000)
    assert len(buffer) == 4 << 20
    pool.give_back(buffer)
    assert pool.take((4 << 20) - 100) is buffer
