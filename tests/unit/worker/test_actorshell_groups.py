"""ActorShell's concurrency groups in one process: the checks of ``concurrency_groups`` and
``@ray.method(concurrency_group=...)``, each group held to its own limit (a threaded actor's
methods on the group's threads, an async actor's on the group's loop), and an async actor's
loop per group (its ``async __init__`` and sync methods there too; a blocked loop stops no
other group)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from podium import errors
from podium.worker.actorshell import (DEFAULT_GROUP, MAX_CONCURRENCY, MAX_GROUPS, ActorShell, check_groups,
                                      check_method_groups, mark_group)

BAD_GROUPS = [
    ("not_a_dict", ["io"], "must be a dict"),
    ("zero", {"io": 0}, "its limit must be an int"),
    ("too_many_threads", {"io": MAX_CONCURRENCY + 1}, "its limit must be an int"),
    ("a_bool", {"io": True}, "its limit must be an int"),
    ("a_string", {"io": "2"}, "its limit must be an int"),
    ("empty_name", {"": 1}, "a concurrency group's name"),
    ("long_name", {"x" * 101: 1}, "a concurrency group's name"),
    ("the_default", {DEFAULT_GROUP: 1}, "max_concurrency"),
    ("too_many_groups", {f"g{i}": 1 for i in range(MAX_GROUPS + 1)}, f"at most {MAX_GROUPS} groups"),
]


@pytest.mark.parametrize("name, groups, text", BAD_GROUPS, ids=[b[0] for b in BAD_GROUPS])
def test_bad_concurrency_groups_are_refused(name, groups, text):
    with pytest.raises(errors.InvalidArgumentError, match=text):
        check_groups(groups)


def test_a_method_in_an_undeclared_group_is_refused_naming_it():
    class Actor:
        def f(self):
            return 1

    mark_group(Actor.f, "io")  # (as @ray.method(concurrency_group="io") does)
    with pytest.raises(errors.InvalidArgumentError, match="Actor.f is in concurrency group 'io'"):
        check_method_groups(Actor, {"control": 1})
    assert check_method_groups(Actor, {"io": 1}) == {"f": "io"}
    with pytest.raises(errors.InvalidArgumentError, match="concurrency_group must be"):
        mark_group(Actor.f, "")


class Counted:
    """Counts the calls running at once in each group; they wait until released."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running: dict[str, int] = {"default": 0, "io": 0}
        self.peak = dict(self.running)
        self.release = threading.Event()

    def _hold(self, group):
        with self.lock:
            self.running[group] += 1
            self.peak[group] = max(self.peak[group], self.running[group])
        self.release.wait(60)
        with self.lock:
            self.running[group] -= 1

    def work(self):
        self._hold("default")

    def fetch(self):
        self._hold("io")

    def status(self):
        return threading.current_thread().name


mark_group(Counted.fetch, "io")
mark_group(Counted.status, "control")


def test_each_group_keeps_its_own_limit():
    async def scenario():
        shell = ActorShell(Counted, 2, (), {}, {"io": 3, "control": 1})
        actor = shell._podium_actor
        calls = ([asyncio.ensure_future(shell.work()) for _ in range(6)]
                 + [asyncio.ensure_future(shell.fetch()) for _ in range(6)])
        for _ in range(2000):  # until both thread groups are full
            if actor.running["default"] == 2 and actor.running["io"] == 3:
                break
            await asyncio.sleep(0.005)
        # The control group answers while the others are full, on a thread of its own.
        assert "control" in await shell.status()
        assert "control" in await shell._podium_call_in_group("control", "status")
        with pytest.raises(errors.InvalidArgumentError, match="not one of this actor's"):
            await shell._podium_call_in_group("nope", "status")
        actor.release.set()
        await asyncio.gather(*calls)
        return actor.peak

    assert asyncio.run(scenario()) == {"default": 2, "io": 3}


class Slots:
    """An async actor counting its calls running at once per group; they wait until released."""

    def __init__(self):
        self.running = {"default": 0, "io": 0}
        self.peak = dict(self.running)
        self.release = threading.Event()

    async def _hold(self, group):
        self.running[group] += 1
        self.peak[group] = max(self.peak[group], self.running[group])
        while not self.release.is_set():  # (each group's loop is its own, not the test's)
            await asyncio.sleep(0.005)
        self.running[group] -= 1

    async def gen(self):
        await self._hold("default")

    async def fetch(self):
        await self._hold("io")

    def where(self):  # a sync method of an async actor: on its group's loop, as in Ray
        return threading.current_thread().name, asyncio.get_running_loop() is not None


mark_group(Slots.fetch, "io")


def test_each_group_of_an_async_actor_keeps_its_own_limit():
    async def scenario():
        shell = ActorShell(Slots, 2, (), {}, {"io": 3})
        actor = shell._podium_actor
        calls = ([asyncio.ensure_future(shell.gen()) for _ in range(6)]
                 + [asyncio.ensure_future(shell.fetch()) for _ in range(6)])
        for _ in range(2000):  # until both groups are full
            if actor.running == {"default": 2, "io": 3}:
                break
            await asyncio.sleep(0.005)
        actor.release.set()
        await asyncio.gather(*calls)
        assert await shell.where() == (f"podium-loop-{DEFAULT_GROUP}", True)
        shell._podium_close()
        return actor.peak

    assert asyncio.run(scenario()) == {"default": 2, "io": 3}


def test_the_default_group_keeps_rays_defaults():
    class Sync:
        def f(self):
            return 1

    class Async:
        async def f(self):
            return 1

    assert ActorShell(Sync, None, (), {}, {"io": 1})._podium_default.limit == 1
    shell = ActorShell(Async, None, (), {}, {"io": 1})
    assert shell._podium_default.limit == 1000
    shell._podium_close()


class Engine:
    """An async actor: ``__init__`` and ``generate`` on the default group's loop, ``status``
    in the group "ctl"; ``block`` blocks its loop (a sync wait inside ``async def``)."""

    async def __init__(self, tag):
        self.tag = tag
        self.init_loop = asyncio.get_running_loop()
        self.init_thread = threading.current_thread().name
        self.entered = threading.Event()
        self.release = threading.Event()

    async def where(self):
        return threading.current_thread().name, asyncio.get_running_loop() is self.init_loop

    async def block(self):
        self.entered.set()
        return self.release.wait(60)  # blocks the default group's loop, as time.sleep would

    async def status(self):
        return self.tag, threading.current_thread().name, asyncio.get_running_loop() is self.init_loop


mark_group(Engine.status, "ctl")


def _loop_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("podium-loop-")}


def test_each_group_of_an_async_actor_has_a_loop_of_its_own():
    before = _loop_threads()

    async def scenario():
        shell = ActorShell(Engine, None, ("e",), {}, {"ctl": 1})
        actor = shell._podium_actor
        # Made with the actor: one loop thread per group, the default one included.
        assert _loop_threads() - before == {f"podium-loop-{DEFAULT_GROUP}", "podium-loop-ctl"}
        # The async __init__ ran on the default group's loop, which runs its methods.
        assert actor.init_thread == f"podium-loop-{DEFAULT_GROUP}"
        assert await shell.where() == (actor.init_thread, True)
        assert await shell.status() == ("e", "podium-loop-ctl", False)
        assert await shell._podium_call_in_group("ctl", "where") == ("podium-loop-ctl", False)
        shell._podium_close()

    asyncio.run(scenario())
    assert _loop_threads() == before  # closed: the threads ended


def test_a_blocked_default_loop_stops_no_other_group_nor_the_callers_loop():
    async def scenario():
        shell = ActorShell(Engine, None, ("e",), {}, {"ctl": 1})
        actor = shell._podium_actor
        blocked = asyncio.ensure_future(shell.block())
        for _ in range(2000):  # until the default group's loop is blocked
            if actor.entered.is_set():
                break
            await asyncio.sleep(0.005)
        assert actor.entered.is_set()
        # The caller's loop (the worker's I/O loop) runs, and the "ctl" group answers.
        assert (await shell.status())[0] == "e"
        assert not blocked.done()
        actor.release.set()
        assert await blocked is True
        shell._podium_close()

    asyncio.run(scenario())


def test_a_sync_actor_makes_no_loop_threads():
    class Sync:
        def f(self):
            return 1

    before = _loop_threads()
    ActorShell(Sync, 4, (), {}, {"io": 1})
    assert _loop_threads() == before
