"""Pending handles of blocking=False calls: laziness, resolution, unpadding, wait (no sockets)."""

from __future__ import annotations

import asyncio
import gc
import threading
import types

import pytest

from podium.controller.dispatch import modes as d
from podium.controller.session import argrefs, gets
from podium.controller.session import futures as fu
from podium.errors import DeadlineExceededError, RemoteError
from podium.refs import DataProtoFuture, ObjectRef


def ref(i: int, rows: int = 3) -> ObjectRef:
    return ObjectRef(object_id=f"o-{i}", worker_id=f"w-{i}", owner_address=f"127.0.0.1:{1000 + i}",
                     owner_rank=i, size_bytes=10, rows=rows)


class _Settler:
    """Settles one PendingRef the way the runtime's loop thread does."""

    def __init__(self, pending_ref: fu.PendingRef) -> None:
        self.ref = pending_ref

    def set_result(self, value) -> None:
        assert self.ref.set_result(value)

    def set_exception(self, exc) -> None:
        assert self.ref.set_exception(exc)


def pending(n: int):
    refs = [fu.PendingRef(i, "m") for i in range(n)]
    return [_Settler(r) for r in refs], refs


def test_pending_future_chunks_lazily_and_resolves_row_ranges():
    futures, refs = pending(4)
    whole = fu.concat_refs(refs)
    assert isinstance(whole, fu.PendingDataProtoFuture) and isinstance(whole, DataProtoFuture)
    parts = whole.unpadded(2).chunk(2)  # 12 rows, 2 of padding -> 10 -> 2 chunks of 5
    assert not whole.done() and all(not p.done() for p in parts)
    for i, f in enumerate(futures):
        f.set_result(ref(i))
    assert whole.done()
    first, second = (p.resolved(timeout=1) for p in parts)
    assert (first.start, first.stop, second.start, second.stop) == (0, 5, 5, 10)
    assert [r.object_id for r, _ in second.parts()] == ["o-1", "o-2", "o-3"]
    assert len(whole) == 12


def test_pending_future_resolves_on_the_loop_too():
    futures, refs = pending(2)
    chunk = fu.concat_refs(refs).chunk(2)[1]

    async def main():
        futures[0].set_result(ref(0, 2))
        futures[1].set_result(ref(1, 2))
        return await chunk.aresolved()

    resolved = asyncio.run(main())
    assert (resolved.start, resolved.stop) == (2, 4)


def test_resolve_args_replaces_only_top_level_pending_handles():
    futures, refs = pending(1)
    futures[0].set_result(ref(0))

    async def main():
        return await argrefs.resolve_args((refs[0], 5, [refs[0]]), {"k": refs[0]})

    args, kwargs = asyncio.run(main())
    assert args[0] == ref(0) and args[1] == 5 and args[2] == [refs[0]] and kwargs == {"k": ref(0)}


def test_errors_and_deadlines_of_pending_refs():
    futures, refs = pending(1)
    with pytest.raises(DeadlineExceededError, match="rank 0"):
        refs[0].ref(timeout=0.01)
    futures[0].set_exception(RemoteError("boom", rank=0))
    with pytest.raises(RemoteError):
        refs[0].ref(timeout=1)


def test_wait_splits_ready_and_pending_in_input_order():
    futures, refs = pending(3)
    futures[2].set_result(ref(2))
    ready, not_ready = gets.wait(refs, num_returns=1, timeout=0)
    assert ready == [refs[2]] and not_ready == [refs[0], refs[1]]
    ready, not_ready = gets.wait(refs, num_returns=2, timeout=0.01)
    assert ready == [refs[2]]
    futures[0].set_result(ref(0))
    ready, not_ready = gets.wait(refs, num_returns=2, timeout=1)
    assert ready == [refs[0], refs[2]] and not_ready == [refs[1]]
    with pytest.raises(ValueError):
        gets.wait(refs, num_returns=4)


def test_collect_of_refs_gives_futures_and_unpads_by_row_range():
    group = types.SimpleNamespace(world_size=4)
    plain = d.collect_dp_compute_data_proto(group, [ref(i) for i in range(4)])
    assert type(plain) is DataProtoFuture and len(plain) == 12
    unpadded = d.unpad_output(plain, 2, 12, 4)
    assert (unpadded.start, unpadded.stop) == (0, 10)
    _, refs = pending(4)
    assert isinstance(d.collect_dp_compute_data_proto(group, refs), fu.PendingDataProtoFuture)


def test_a_ref_settles_once():
    settlers, refs = pending(1)
    settlers[0].set_result(ref(0))
    assert not refs[0].set_exception(RemoteError("late", rank=0))
    assert refs[0].ref(timeout=0) == ref(0)


def test_waiters_in_other_threads_wake_when_the_loop_thread_settles():
    settlers, refs = pending(200)
    results = {}

    def waiter(name, which):
        results[name] = fu.wait_all(which, timeout=30)

    threads = [threading.Thread(target=waiter, args=("all", refs)),
               threading.Thread(target=waiter, args=("last", refs[-1:])),
               threading.Thread(target=lambda: results.setdefault("ray.wait", gets.wait(refs, 200, 30)))]
    for t in threads:
        t.start()

    async def settle_in_bursts():
        for i, settler in enumerate(settlers):
            settler.set_result(ref(i))
            if i % 50 == 0:
                await asyncio.sleep(0.001)  # let the waiters run in between

    asyncio.run(settle_in_bursts())
    for t in threads:
        t.join(30)
    assert results["all"] is True and results["last"] is True
    assert results["ray.wait"] == (refs, [])
    assert fu.wait_all(refs, timeout=0) is True


def test_wait_all_gives_up_at_its_deadline():
    _, refs = pending(2)
    assert fu.wait_all(refs, timeout=0.05) is False
    assert not any(r.done() for r in refs)


def test_aref_wakes_when_settled_from_another_thread():
    settlers, refs = pending(1)

    async def main():
        threading.Timer(0.05, settlers[0].set_result, (ref(0),)).start()
        return await asyncio.wait_for(refs[0].aref(), 30)

    assert asyncio.run(main()) == ref(0)


def test_a_garbage_ref_releases_its_held_result_only_after_success():
    released = []
    ok = fu.PendingRef(0, "m", released.append)
    failed = fu.PendingRef(1, "m", released.append)
    unfinished = fu.PendingRef(2, "m", released.append)
    ok.set_result(ref(0))
    failed.set_exception(RemoteError("boom", rank=1))
    del ok, failed, unfinished
    gc.collect()
    assert released == ["o-0"]


def test_get_of_refs_with_inline_values_waits_for_them(monkeypatch):
    from podium import codec
    rt = types.SimpleNamespace(call_timeout=30, stats={"fetches": 0, "fetched_bytes": 0})
    monkeypatch.setattr("podium.controller.session.runtime.get_runtime", lambda: rt)
    settlers, refs = pending(3)
    inline = b"".join(codec.encode("value").to_segments())

    def settle():
        for i, settler in enumerate(settlers):
            settler.set_result(ObjectRef(f"o-{i}", "w", "a:1", i, len(inline), -1, inline))

    threading.Timer(0.05, settle).start()
    assert gets.get(refs) == ["value"] * 3
    assert rt.stats["fetches"] == 3
