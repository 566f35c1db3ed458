"""GroupGather: a blocking group call's outcomes, one slot per rank, one future for all."""

from __future__ import annotations

import asyncio
import gc
import weakref

from podium.controller.group.gather import GroupGather, RankOutcome


def test_it_waits_for_every_rank_and_keeps_their_order():
    async def go():
        gather = GroupGather(3)
        waiting = asyncio.ensure_future(gather.first_failure_or_all())
        for index in (2, 0):
            gather.ranks[index].set_result(f"v{index}")
        await asyncio.sleep(0)
        assert not waiting.done()  # rank 1 has not answered
        gather.ranks[1].set_result("v1")
        await asyncio.wait_for(waiting, 5)
        assert gather.values() == ["v0", "v1", "v2"] and gather.failed() == []
        await asyncio.wait_for(gather.all_settled(5), 5)  # already all in: returns at once

    asyncio.run(go())


def test_the_first_failure_ends_the_wait_and_the_rest_still_land():
    async def go():
        gather = GroupGather(4)
        boom = ValueError("boom")
        RankOutcome.set_exception(gather.ranks[2], boom)  # as submit_into calls on_error(sink, exc)
        await asyncio.wait_for(gather.first_failure_or_all(), 5)  # without ranks 0, 1, 3
        assert gather.failed() == [2] and gather.ranks[2].error is boom
        assert [outcome.done() for outcome in gather.ranks] == [False, False, True, False]
        # A rank's outcome is settled once: a later one is dropped.
        gather.ranks[2].set_result("late")
        assert gather.ranks[2].value is None and gather.ranks[2].error is boom
        # The others may still answer or fail; all_settled waits for them, within its bound.
        settled = asyncio.ensure_future(gather.all_settled(5))
        gather.ranks[0].set_result(0)
        gather.ranks[1].set_exception(TimeoutError())
        gather.ranks[3].set_result(3)
        await asyncio.wait_for(settled, 5)
        assert gather.failed() == [1, 2]

    asyncio.run(go())


def test_waiting_for_silent_ranks_is_bounded_and_no_rank_is_instant():
    async def go():
        gather = GroupGather(2)
        gather.ranks[0].set_result(1)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await gather.all_settled(0.05)  # rank 1 never answers
        assert loop.time() - began < 5 and not gather.ranks[1].done()
        await asyncio.wait_for(GroupGather(0).first_failure_or_all(), 5)

    asyncio.run(go())


def test_a_dropped_gather_frees_its_values_without_a_collection():
    """The values are views of received buffers (shared-memory segments that go back for
    reuse when the last view dies): they must go with the gather, not at a later collection."""
    class Value:
        pass

    async def go():
        gather = GroupGather(2)
        value = Value()
        alive = weakref.ref(value)
        gather.ranks[0].set_result(value)
        gather.ranks[1].set_result(None)
        del value
        await gather.first_failure_or_all()
        del gather
        assert alive() is None

    gc.disable()
    try:
        asyncio.run(go())
    finally:
        gc.enable()
