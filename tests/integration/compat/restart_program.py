"""Actor restarts and task retries: a Ray program run under ``podium run``.

Plain ``import ray``. Prints one ``name: value`` line per check (test_restarts.py reads them)
and ``PROGRAM OK`` at the end. Each actor death is a SIGKILL sent from outside the actor.
Run it with real Ray to compare: ``python restart_program.py DIR``.
"""

import os
import signal
import sys
import time

import ray


@ray.remote(max_restarts=2)
class Counter:
    def __init__(self, start):
        self.n = start

    def incr(self):
        self.n += 1
        return self.n

    def pid(self):
        return os.getpid()

    def sleep(self, seconds):
        time.sleep(seconds)
        return seconds


@ray.remote
class Borrower:
    """Holds a handle to the counter, passed in its constructor."""

    def __init__(self, counter):
        self.counter = counter

    def incr(self):
        return ray.get(self.counter.incr.remote())


@ray.remote(max_restarts=-1, max_task_retries=-1)
class Forever:
    def pid(self):
        return os.getpid()


@ray.remote(max_restarts=1, max_task_retries=1)
class Retried:
    def __init__(self):
        self.calls = 0

    def pid(self):
        return os.getpid()

    def slow(self, seconds):
        self.calls += 1
        time.sleep(seconds)
        return f"done after {self.calls} call(s) on this incarnation"


@ray.remote
def dies_once(marker):
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)
    return "ran again"


@ray.remote(max_retries=0)
def dies_no_retry(marker):
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)
    return "ran again"


def raises_until(counter_file, times, exc_type):
    count = int(open(counter_file).read()) if os.path.exists(counter_file) else 0
    with open(counter_file, "w") as f:
        f.write(str(count + 1))
    if count < times:
        raise exc_type(f"attempt {count + 1}")
    return f"succeeded on attempt {count + 1}"


flaky = ray.remote(raises_until)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def gone(pid, seconds=10.0):
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


def live_workers_named(fragment):
    from podium.controller.session.runtime import get_runtime

    rt = get_runtime()
    state = rt.run(rt.scheduler.cluster_state(), timeout=30)
    return [w for w in state.workers if fragment in w.spec.name and w.state in (1, 2)]


def main(workdir):
    ray.init()
    counter = Counter.options(name="counter").remote(10)
    borrower = Borrower.remote(counter)
    print("first incr:", ray.get(counter.incr.remote()))
    print("through borrower:", ray.get(borrower.incr.remote()))

    for round_ in (1, 2):
        pid = ray.get(counter.pid.remote())
        in_flight = counter.sleep.remote(60)
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        try:
            ray.get(in_flight)
            print(f"in flight {round_}:", "no error")
        except ray.exceptions.ActorUnavailableError as exc:
            print(f"in flight {round_}:", type(exc).__name__)
        found = ray.get_actor("counter")  # while it restarts: waits for it, as Ray's finds it
        print(f"state after restart {round_}:", ray.get(counter.incr.remote()))
        print(f"new process {round_}:", ray.get(counter.pid.remote()) != pid, gone(pid))
        print(f"by name {round_}:", ray.get(found.incr.remote()))
        print(f"borrower {round_}:", ray.get(borrower.incr.remote()))
        print(f"restarts {round_}:", [w.spec.restarts for w in live_workers_named("counter")])

    pid = ray.get(counter.pid.remote())
    in_flight = counter.sleep.remote(60)
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    for label, ref in (("in flight 3", in_flight), ("after last death", None)):
        try:
            ray.get(ref if ref is not None else counter.incr.remote())
            print(f"{label}:", "no error")
        except ray.exceptions.ActorDiedError as exc:
            unavailable = isinstance(exc, ray.exceptions.ActorUnavailableError)
            print(f"{label}:", type(exc).__name__, unavailable, "restarted 2 times" in str(exc))
    try:
        ray.get(borrower.incr.remote())
        print("borrower after last death:", "no error")
    except ray.exceptions.RayTaskError as exc:
        print("borrower after last death:", "restarted 2 times" in str(exc))
    print("live counter workers:", len(live_workers_named("counter")))

    forever = Forever.remote()
    ray.get(forever.pid.remote())
    cpus = ray.available_resources().get("CPU")
    pids = []
    for _ in range(20):
        pid = ray.get(forever.pid.remote())
        pids.append(pid)
        os.kill(pid, signal.SIGKILL)
    last = ray.get(forever.pid.remote())
    print("forever distinct pids:", len(set(pids + [last])))
    print("forever old processes gone:", all(gone(p) for p in pids))
    print("forever live workers:", len(live_workers_named("Forever")),
          max(w.spec.restarts for w in live_workers_named("Forever")))
    print("forever CPUs free as before:", ray.available_resources().get("CPU") == cpus)

    retried = Retried.remote()
    pid = ray.get(retried.pid.remote())
    ref = retried.slow.remote(2)
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    print("max_task_retries:", ray.get(ref))

    print("task default retries:", ray.get(dies_once.remote(os.path.join(workdir, "once"))))
    try:
        ray.get(dies_no_retry.remote(os.path.join(workdir, "never")))
        print("task max_retries=0:", "no error")
    except ray.exceptions.WorkerCrashedError as exc:
        print("task max_retries=0:", type(exc).__name__)
    print("retry_exceptions:", ray.get(flaky.options(max_retries=3, retry_exceptions=[ValueError]).remote(
        os.path.join(workdir, "c1"), 2, ValueError)))
    try:
        ray.get(flaky.options(max_retries=3, retry_exceptions=[KeyError]).remote(
            os.path.join(workdir, "c2"), 2, ValueError))
        print("other exception:", "no error")
    except ray.exceptions.RayTaskError as exc:
        print("other exception:", "ValueError" in str(exc), open(os.path.join(workdir, "c2")).read())
    try:
        ray.get(flaky.options(max_retries=1, retry_exceptions=True).remote(
            os.path.join(workdir, "c3"), 5, ValueError))
        print("retries used up:", "no error")
    except ray.exceptions.RayTaskError:
        print("retries used up:", open(os.path.join(workdir, "c3")).read())
    print("PROGRAM OK")


if __name__ == "__main__":
    main(sys.argv[1])
