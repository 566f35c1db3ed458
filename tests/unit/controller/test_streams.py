"""The caller's side of a streaming call (podium.controller.remote.streams.ObjectRefGenerator),
driven with a fake group caller whose refs the test settles: what it sends, the items, the
error item, the end, a call that failed outright, a finished call whose items still come, async
iteration, and the close a dropped generator sends."""

from __future__ import annotations

import asyncio
import gc
import pickle
import threading

import pytest

from podium import errors
from podium.controller.remote.streams import ObjectRefGenerator
from podium.controller.session.futures import PendingRef
from podium.refs import ObjectRef
from podium.worker.caller.streaming import STREAM_CALL, STREAM_CLOSE_CALL, STREAM_NEXT_CALL, end_of_stream


class FakeCalls:
    """A one-worker group's caller: records each call and returns its (unsettled) ref."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple, PendingRef]] = []
        self.changed = threading.Condition()

    def run(self, ranks: list[int], method: str, per_rank: list, blocking: bool) -> list[PendingRef]:
        assert ranks == [0] and not blocking
        ref = PendingRef(0, method)
        with self.changed:
            self.sent.append((method, per_rank[0][0], ref))
            self.changed.notify_all()
        return [ref]

    def asked(self) -> PendingRef:
        """The next call in flight (the last one sent)."""
        method, _, ref = self.sent[-1]
        assert method == STREAM_NEXT_CALL
        return ref

    def wait_for(self, method: str) -> tuple:
        with self.changed:
            assert self.changed.wait_for(lambda: any(m == method for m, _, _ in self.sent), 30)
            return next(s for s in self.sent if s[0] == method)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def item(n: int) -> ObjectRef:
    return ObjectRef(f"o-{n}", "w-1", "127.0.0.1:1", 0, 8)


def make(calls: FakeCalls, loop) -> ObjectRefGenerator:
    return ObjectRefGenerator(calls, "gen", (1, 2), {"k": 3}, 4, "io", None, loop)


def test_it_sends_the_call_and_asks_for_the_first_item_at_once(loop):
    calls = FakeCalls()
    gen = make(calls, loop)
    (method, args, _), (asked, asked_args, _) = calls.sent
    stream_id = args[0]
    assert method == STREAM_CALL + "gen" and args == (stream_id, 4, "io", 1, 2)
    assert asked == STREAM_NEXT_CALL and asked_args == (stream_id,)
    assert len(stream_id) == 16 and stream_id != make(FakeCalls(), loop)._id
    assert not gen.next_ready() and not gen.is_finished()


def test_items_then_the_end(loop):
    calls = FakeCalls()
    gen = make(calls, loop)
    for n in range(2):
        calls.asked().set_result(item(n))
        assert gen.next_ready()
        assert next(gen).ref() == item(n)
    calls.asked().set_exception(end_of_stream("x"))
    assert gen.is_finished() and not gen.next_ready()
    with pytest.raises(StopIteration):
        next(gen)
    assert list(gen) == []
    assert len(calls.sent) == 4  # the call and three nexts; nothing after the end


def test_the_error_is_one_ref_then_the_end(loop):
    calls = FakeCalls()
    gen = make(calls, loop)
    calls.asked().set_exception(errors.RemoteError("boom", remote_type="ValueError"))
    failed = next(gen)
    with pytest.raises(errors.RemoteError, match="boom"):
        failed.ref()
    with pytest.raises(StopIteration):
        next(gen)
    assert gen.is_finished()


def test_a_call_that_failed_outright_is_the_next_ref_and_the_stream_is_closed(loop):
    calls = FakeCalls()
    gen = make(calls, loop)
    main = gen.completed()
    main.set_exception(errors.WorkerDiedError("the worker died (exit code 7)"))
    failed = next(gen)  # the next call in flight never answers: the call's error is the item
    assert failed is main
    with pytest.raises(errors.WorkerDiedError, match="exit code 7"):
        failed.ref()
    _, args, _ = calls.wait_for(STREAM_CLOSE_CALL)
    assert args == (gen._id, True)  # final: the worker keeps nothing of it
    with pytest.raises(StopIteration):
        next(gen)


def test_the_items_of_a_call_that_finished_still_come(loop):
    calls = FakeCalls()
    gen = make(calls, loop)
    gen.completed().set_result(item(99))  # the generator ended; its last item is not taken yet
    got: list = []
    reader = threading.Thread(target=lambda: got.append(next(gen)))
    reader.start()
    calls.asked().set_result(item(0))
    reader.join(30)
    assert got[0].ref() == item(0)


def test_async_iteration(loop):
    calls = FakeCalls()
    gen = make(calls, loop)

    async def main() -> list:
        out = []
        waiting = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        assert not waiting.done()
        calls.asked().set_result(item(0))
        out.append(await waiting)
        asyncio.get_running_loop().call_soon(calls.asked().set_exception, end_of_stream("x"))
        async for ref in gen:
            out.append(ref)
        return out
    refs = asyncio.run(main())
    assert [r.ref() for r in refs] == [item(0)]


def test_a_dropped_generator_closes_its_stream(loop):
    calls = FakeCalls()
    gen = make(calls, loop)
    stream_id = gen._id
    del gen
    gc.collect()
    _, args, _ = calls.wait_for(STREAM_CLOSE_CALL)
    assert args == (stream_id, False)  # the call still runs: the worker closes its generator


def test_what_ray_refuses(loop):
    gen = make(FakeCalls(), loop)
    with pytest.raises(TypeError, match="Serializing a ObjectRefGenerator is not allowed"):
        pickle.dumps(gen)
    for refused in (lambda: gen.send(1), lambda: gen.throw(ValueError), gen.close):
        with pytest.raises(NotImplementedError):
            refused()
