"""Run under ``podium run --num-cpus 4`` with a small ``PODIUM_LIVENESS_SECONDS`` (L): async
actors as Ray runs them, with plain ``import ray``. Prints one ``name: value`` line per case
(test_async_actors.py reads them) and ``ASYNC ACTORS OK`` last.

- An ``async def __init__`` that blocks its loop for L + 5 s (a vLLM engine built inside it)
  is waited for: the actor is constructed and answers, as in Ray.
- A default-group method that blocks its group's loop (a sync wait in ``async def``) for
  longer than L stops neither a method of the group "ctl" nor the actor's liveness.
- An async actor stopped with SIGSTOP is still found: its pending call fails with
  UnresponsiveError.
- A constructor that never returns is the caller's to bound: ``ray.get`` of
  ``actor.__ray_ready__.remote()`` with a timeout gives GetTimeoutError.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import ray

LIVENESS = float(os.environ["PODIUM_LIVENESS_SECONDS"])
WAIT_S = 120  # a blocked call waits at most this long (the test fails rather than hangs)


@ray.remote
class SlowStart:
    """Its async __init__ blocks its loop past the liveness bound."""

    async def __init__(self, seconds):
        time.sleep(seconds)
        self.loop = asyncio.get_running_loop()

    async def ping(self):
        return "pong", asyncio.get_running_loop() is self.loop  # methods run on __init__'s loop


@ray.remote(concurrency_groups={"ctl": 1})
class Engine:
    """``generate`` (the default group) blocks its loop until ``open`` (group "ctl")."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    async def generate(self, seconds):
        self.entered.set()
        return self.release.wait(seconds)

    @ray.method(concurrency_group="ctl")
    async def status(self):
        return self.entered.is_set()

    @ray.method(concurrency_group="ctl")
    async def open(self):
        self.release.set()


@ray.remote
class Napper:
    async def pid(self):
        return os.getpid()

    async def nap(self, seconds):
        await asyncio.sleep(seconds)
        return seconds


@ray.remote
class NeverReady:
    async def __init__(self):
        time.sleep(3600)

    async def ping(self):
        return "never"


def until(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def error_name(ref) -> str:
    try:
        ray.get(ref, timeout=WAIT_S)
    except Exception as exc:  # noqa: BLE001 - which error is what is checked
        return type(exc).__name__
    return "no error"


def main() -> None:
    slow = SlowStart.remote(LIVENESS + 5)
    print("slow constructor ready:", ray.get(slow.__ray_ready__.remote(), timeout=WAIT_S))
    print("slow constructor answers:", ray.get(slow.ping.remote(), timeout=WAIT_S) == ("pong", True))

    engine = Engine.remote()
    generated = engine.generate.remote(WAIT_S)
    until(lambda: ray.get(engine.status.remote(), timeout=WAIT_S), "the default group's loop blocked")
    time.sleep(LIVENESS + 1)  # blocked past the liveness bound while its call is pending
    print("ctl answers while default blocked:", ray.get(engine.status.remote(), timeout=WAIT_S))
    ray.get(engine.open.remote(), timeout=WAIT_S)
    print("blocked call finished:", ray.get(generated, timeout=WAIT_S))

    napper = Napper.remote()
    pid = ray.get(napper.pid.remote(), timeout=WAIT_S)
    pending = napper.nap.remote(WAIT_S)
    time.sleep(0.5)
    os.kill(pid, signal.SIGSTOP)
    try:
        print("stopped actor's call:", error_name(pending))
    finally:
        os.kill(pid, signal.SIGKILL)

    never = NeverReady.remote()
    try:
        ray.get(never.__ray_ready__.remote(), timeout=LIVENESS + 3)
        print("never-ready constructor: ready")
    except ray.exceptions.GetTimeoutError as exc:
        print("never-ready constructor:", type(exc).__name__)
    ray.kill(never)
    print("ASYNC ACTORS OK")


if __name__ == "__main__":
    main()
