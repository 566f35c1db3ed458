"""ActorShell's concurrency groups in one process: the checks of ``concurrency_groups`` and
``@ray.method(concurrency_group=...)``, and each group held to its own limit (sync methods
on the group's threads, async methods in its slots)."""

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
        self.running: dict[str, int] = {"default": 0, "io": 0, "aio": 0}
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

    async def agen(self, gate):
        with self.lock:
            self.running["aio"] += 1
            self.peak["aio"] = max(self.peak["aio"], self.running["aio"])
        await gate.wait()
        with self.lock:
            self.running["aio"] -= 1

    def status(self):
        return threading.current_thread().name


mark_group(Counted.fetch, "io")
mark_group(Counted.status, "control")


def test_each_group_keeps_its_own_limit():
    async def scenario():
        shell = ActorShell(Counted, 2, (), {}, {"io": 3, "control": 1})
        actor = shell._podium_actor
        gate = asyncio.Event()
        calls = ([asyncio.ensure_future(shell.work()) for _ in range(6)]
                 + [asyncio.ensure_future(shell.fetch()) for _ in range(6)]
                 + [asyncio.ensure_future(shell.agen(gate)) for _ in range(5)])
        for _ in range(2000):  # until both thread groups are full
            if actor.running["default"] == 2 and actor.running["io"] == 3 and actor.running["aio"] == 2:
                break
            await asyncio.sleep(0.005)
        # The control group answers while the others are full, on a thread of its own.
        assert "control" in await shell.status()
        assert "control" in await shell._podium_call_in_group("control", "status")
        with pytest.raises(errors.InvalidArgumentError, match="not one of this actor's"):
            await shell._podium_call_in_group("nope", "status")
        actor.release.set()
        gate.set()
        await asyncio.gather(*calls)
        return actor.peak

    assert asyncio.run(scenario()) == {"default": 2, "io": 3, "aio": 2}


def test_the_default_group_keeps_rays_defaults():
    class Sync:
        def f(self):
            return 1

    class Async:
        async def f(self):
            return 1

    assert ActorShell(Sync, None, (), {}, {"io": 1})._podium_default.limit == 1
    assert ActorShell(Async, None, (), {}, {"io": 1})._podium_default.limit == 1000
