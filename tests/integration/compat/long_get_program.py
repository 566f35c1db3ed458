"""A TaskRunner-style ``ray.get`` that lasts longer than a deadline would: run under
``podium run`` with ``PODIUM_CALL_TIMEOUT`` unset (waits), set (fails on time), and with the
actor killed mid-call (fails at once). Prints ``name: value`` lines for test_travel.py."""

import os
import signal
import sys
import time

import ray


@ray.remote
class TaskRunner:
    def run(self, seconds):
        time.sleep(seconds)
        return "done"

    def pid(self):
        return os.getpid()


def main(mode):
    ray.init()
    runner = TaskRunner.remote()
    if mode == "long":
        from podium.controller.session.runtime import get_runtime
        print("default deadline:", get_runtime().call_timeout)
        print("long get:", ray.get(runner.run.remote(8)))
    elif mode == "deadline":
        try:
            ray.get(runner.run.remote(8))
            print("deadline: none")
        except ray.exceptions.GetTimeoutError as exc:
            print("deadline:", type(exc).__name__, exc)
    elif mode == "unkept":
        print("unkept:", ray.get(TaskRunner.remote().run.remote(1)))
    elif mode == "dies":
        pid = ray.get(runner.pid.remote())
        ref = runner.run.remote(3600)
        time.sleep(1)
        os.kill(pid, signal.SIGKILL)
        try:
            ray.get(ref)
            print("dies: no error")
        except ray.exceptions.ActorDiedError as exc:
            print("dies:", type(exc).__name__, "SIGKILL" in str(exc))
    print("PROGRAM OK")


if __name__ == "__main__":
    main(sys.argv[1])
