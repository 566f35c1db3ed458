"""A restartable actor that stops answering (SIGSTOP) while a call is pending: the call fails
with UnresponsiveError and the actor is stopped and restarted (test_restarts.py runs it under
``podium run`` with PODIUM_LIVENESS_SECONDS=2)."""

import os
import signal
import time

import ray


@ray.remote(max_restarts=1)
class Sleeper:
    def pid(self):
        return os.getpid()

    def sleep(self, seconds):
        time.sleep(seconds)
        return seconds


def main():
    ray.init()
    actor = Sleeper.remote()
    pid = ray.get(actor.pid.remote())
    pending = actor.sleep.remote(120)
    time.sleep(0.5)
    os.kill(pid, signal.SIGSTOP)
    try:
        ray.get(pending)
        print("pending call:", "no error")
    except ray.exceptions.GetTimeoutError as exc:  # UnresponsiveError is a DeadlineExceededError
        print("pending call:", type(exc).__name__)
    print("restarted:", ray.get(actor.pid.remote()) != pid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
    print("hung process stopped:", time.monotonic() < deadline)
    print("PROGRAM OK")


if __name__ == "__main__":
    main()
