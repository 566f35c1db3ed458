"""Run under ``podium run --num-cpus 4``: Ray's concurrency groups with plain ``import ray``.
A sync actor and an async actor each have their default group filled by calls that wait,
and a control method in a group of its own answers meanwhile; no group runs more calls at
once than its limit; bad options are refused. Prints ``CONCURRENCY GROUPS OK`` last."""

from __future__ import annotations

import asyncio
import threading
import time

import ray

WAIT_S = 120  # a blocked call waits at most this long (the test fails rather than hangs)


def until(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


@ray.remote(concurrency_groups={"io": 2, "control": 1})
class Threaded:
    """A sync actor: the default group (max_concurrency) and "io" wait until opened."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = {"default": 0, "io": 0}
        self.peak = {"default": 0, "io": 0}
        self.gate = threading.Event()

    def _hold(self, group):
        with self.lock:
            self.running[group] += 1
            self.peak[group] = max(self.peak[group], self.running[group])
        try:
            assert self.gate.wait(WAIT_S), "never opened"
        finally:
            with self.lock:
                self.running[group] -= 1
        return group

    def work(self):
        return self._hold("default")

    @ray.method(concurrency_group="io")
    def fetch(self):
        return self._hold("io")

    @ray.method(concurrency_group="control")
    def status(self):
        with self.lock:
            return dict(self.running), dict(self.peak), threading.current_thread().name

    @ray.method(concurrency_group="control")
    def open(self):
        self.gate.set()

    def ping(self):  # in the default group, unless a call names another
        return "pong"


@ray.remote(concurrency_groups={"control": 1})
class Engine:
    """An async actor: ``generate`` (the default group) waits until opened."""

    def __init__(self):
        self.running = 0
        self.peak = 0
        self.gate = self.loop = None

    async def generate(self, i):
        if self.gate is None:  # (an asyncio.Event belongs to the default group's loop)
            self.loop, self.gate = asyncio.get_running_loop(), asyncio.Event()
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.wait_for(self.gate.wait(), WAIT_S)
        finally:
            self.running -= 1
        return i

    @ray.method(concurrency_group="control")
    async def status(self):
        return self.running, self.peak

    @ray.method(concurrency_group="control")
    async def open(self):
        # "control" has its own loop, as in Ray: the default group's Event is set on its loop.
        self.loop.call_soon_threadsafe(self.gate.set)


# A sync actor: 2 threads in the default group, 2 in "io", 1 in "control".
threaded = Threaded.options(max_concurrency=2).remote()
work = [threaded.work.remote() for _ in range(6)]
fetches = [threaded.fetch.remote() for _ in range(5)]
until(lambda: ray.get(threaded.status.remote(), timeout=WAIT_S)[0] == {"default": 2, "io": 2},
      "both groups of the sync actor full")
running, peak, thread = ray.get(threaded.status.remote(), timeout=WAIT_S)  # answers while they are full
assert running == {"default": 2, "io": 2} and "control" in thread, (running, thread)
# A call may name another group: ping (default group, full) runs in "control" now.
assert ray.get(threaded.ping.options(concurrency_group="control").remote(), timeout=WAIT_S) == "pong"
ready, _ = ray.wait(work + fetches, num_returns=1, timeout=0.5)
assert not ready, "a blocked call finished before the gate opened"
ray.get(threaded.open.remote(), timeout=WAIT_S)
assert ray.get(work, timeout=WAIT_S) == ["default"] * 6 and ray.get(fetches, timeout=WAIT_S) == ["io"] * 5
_, peak, _ = ray.get(threaded.status.remote(), timeout=WAIT_S)
assert peak == {"default": 2, "io": 2}, peak  # each group held to its own limit
print("sync actor: ok")

# An async actor: 3 slots in the default group, its control method in a group of its own.
engine = Engine.options(max_concurrency=3).remote()
generated = [engine.generate.remote(i) for i in range(20)]
until(lambda: ray.get(engine.status.remote(), timeout=WAIT_S)[0] == 3, "the async actor's default group full")
assert ray.get(engine.status.remote(), timeout=WAIT_S) == (3, 3)
ray.get(engine.open.remote(), timeout=WAIT_S)
assert ray.get(generated, timeout=WAIT_S) == list(range(20))
assert ray.get(engine.status.remote(), timeout=WAIT_S) == (0, 3)
print("async actor: ok")


def refused(make, text: str) -> None:
    try:
        make()
    except Exception as exc:  # noqa: BLE001 - the error's words are what is checked
        assert text in str(exc), (text, str(exc))
        return
    raise AssertionError(f"not refused: {text}")


class Plain:
    def f(self):
        return 1


refused(lambda: ray.remote(concurrency_groups={"io": 0})(Plain), "its limit must be an int")
refused(lambda: ray.remote(concurrency_groups={"io": "2"})(Plain), "its limit must be an int")
refused(lambda: ray.remote(concurrency_groups={"": 1})(Plain), "a concurrency group's name")
refused(lambda: ray.remote(concurrency_groups=["io"])(Plain), "must be a dict")
refused(lambda: ray.remote(concurrency_groups={f"g{i}": 1 for i in range(65)})(Plain), "at most 64 groups")
refused(lambda: ray.remote(Plain).options(concurrency_groups={"io": 10**6}), "its limit must be an int")
refused(lambda: ray.method(concurrency_group=""), "concurrency_group must be")


class Misplaced:
    @ray.method(concurrency_group="nope")
    def f(self):
        return 1


refused(lambda: ray.remote(concurrency_groups={"io": 1})(Misplaced).remote(),
        "Misplaced.f is in concurrency group 'nope'")
refused(lambda: ray.remote(Misplaced).remote(), "Misplaced.f is in concurrency group 'nope'")
refused(lambda: ray.get(threaded.ping.options(concurrency_group="nope").remote(), timeout=WAIT_S),
        "concurrency group 'nope' is not one of this actor's")
plain = ray.remote(Plain).remote()
refused(lambda: ray.get(plain.f.options(concurrency_group="io").remote(), timeout=WAIT_S),
        "declares no concurrency_groups")
print("CONCURRENCY GROUPS OK")
