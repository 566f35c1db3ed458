"""The owner's borrower watch (worker/host/borrowerwatch.py): a borrower whose address
refuses connections has ended and its borrows are given back; one that cannot be reached
(a partition: every look runs past its deadline) keeps its borrows until the bound tied to
the scheduler's node lease, not after a couple of missed looks."""

import asyncio
import socket

from podium.scheduler.records import DEFAULT_NODE_LEASE
from podium.worker.host import borrowerwatch
from podium.worker.host.borrowerwatch import BorrowerWatch
from podium.worker.host.heldstore import HeldStore


def _lend(borrower: str) -> tuple[HeldStore, str]:
    held = HeldStore(1 << 20)
    object_id = held.put("value", None, 5, -1).object_id
    held.borrow([object_id], borrower)
    held.release([object_id])  # the owner let go: only the borrow keeps it
    assert object_id in held
    return held, object_id


async def _watch_until(watch: BorrowerWatch, done, looks: int) -> None:
    watch.ensure()
    for _ in range(looks):
        if done():
            return
        await asyncio.sleep(0.02)


def test_the_bound_is_past_the_schedulers_node_lease():
    assert borrowerwatch.UNREACHABLE_SECONDS >= 2 * DEFAULT_NODE_LEASE


def test_a_borrower_whose_address_refuses_is_gone():
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    address = "127.0.0.1:%d" % closed.getsockname()[1]
    closed.close()  # nothing listens there: connections are refused
    held, object_id = _lend(address)
    watch = BorrowerWatch(held, "token", None, interval=0.01, unreachable_seconds=3600)
    asyncio.run(_watch_until(watch, lambda: object_id not in held, 3000))
    assert object_id not in held and watch.found == 1 and held.borrowers() == []


def _black_hole() -> tuple[socket.socket, str]:
    # Accepts TCP (the kernel's backlog) and never speaks: each look runs past its deadline,
    # as across a partition.
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    return hole, "127.0.0.1:%d" % hole.getsockname()[1]


def test_an_unreached_borrower_keeps_its_borrows_within_the_bound():
    hole, address = _black_hole()
    with hole:
        held, object_id = _lend(address)
        watch = BorrowerWatch(held, "token", None, interval=0.01, look_timeout=0.05, unreachable_seconds=3600)

        async def run() -> None:
            watch.ensure()
            for _ in range(20):  # many missed looks, each past its deadline
                await asyncio.sleep(0.06)
            assert watch._task is not None
            watch._task.cancel()

        asyncio.run(run())
        assert object_id in held and held.borrow_count(object_id) == 1 and watch.found == 0


def test_an_unreached_borrower_is_gone_past_the_bound():
    hole, address = _black_hole()
    with hole:
        held, object_id = _lend(address)
        watch = BorrowerWatch(held, "token", None, interval=0.01, look_timeout=0.05, unreachable_seconds=0.3)
        asyncio.run(_watch_until(watch, lambda: object_id not in held, 3000))
        assert object_id not in held and watch.found == 1
