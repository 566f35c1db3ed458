"""A finished call's arguments die by reference counting, before its reply: nothing in the
worker host keeps them (no local of the stream's read loop, no reference cycle that waits
for the cyclic collector). A ref a method only read is then given back within the call, and
a borrower's count at the owner does not depend on when ``gc`` runs (podium.borrows)."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest

from tests.support.hostkit import hosted


class Marker:
    """An argument a test can watch (a weakref to it)."""


def watch_sync(obj, box, *rest):
    obj.seen = weakref.ref(box["marker"])  # (the hosted object lives in this process)
    return "ran"


async def watch_async(obj, box, *rest):
    obj.seen = weakref.ref(box["marker"])
    return "ran"


@contextlib.contextmanager
def no_cyclic_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", ["sync", "async", "sync with a ref argument", "async with a ref argument"])
def test_a_finished_calls_arguments_are_dead_without_gc(token, arun, kind):
    fn = watch_async if kind.startswith("async") else watch_sync

    async def scenario():
        async with hosted(token) as (host, client):
            extra = ()
            if kind.endswith("ref argument"):  # the loop's general path: materialized first
                extra = (await client.call("echo", ([1, 2],), hold=True),)
            with no_cyclic_gc():
                # The host runs in this process: the weakref tells whether anything there
                # still holds the argument once the reply is here.
                assert await client.call("__ray_call__", (fn, {"marker": Marker()}, *extra)) == "ran"
                seen = host.runtime.hosted.seen
                assert seen() is None, f"{kind}: the argument outlived its call"
    arun(scenario())
