"""How fast an actor with ``max_restarts=-1`` comes back, and what 100 deaths leave behind:
``python -m bench.actor_restart [--deaths 100]``.

One embedded cluster, one actor (``max_restarts=-1, max_task_retries=-1``, an empty
constructor). Each round sends SIGKILL to the actor's process from here and times until a
call answers from the new process (the death noticed, the old worker's exit recorded, a new
worker placed, started and constructed). After the last round it checks what is left: the
old processes (each must be gone), the live workers under the actor's name (must be one) and
the CPUs the cluster has free (must be what they were with the actor alive).

It prints one JSON line: the median, p90 and max seconds from death to answer, and the checks.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time

import podium


@podium.remote(max_restarts=-1, max_task_retries=-1)
class Phoenix:
    """Answers with its process id."""

    def pid(self) -> int:
        """This incarnation's process id."""
        return os.getpid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _live_workers(name: str) -> int:
    from podium.controller.session.runtime import get_runtime

    rt = get_runtime()
    state = rt.run(rt.scheduler.cluster_state(), timeout=30)
    return sum(1 for w in state.workers if name in w.spec.name and w.state in (1, 2))


def main() -> None:
    """Run the rounds and print the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deaths", type=int, default=100)
    args = parser.parse_args()
    podium.init(num_cpus=4)
    actor = Phoenix.options(name="phoenix").remote()
    pid = podium.get(actor.pid.remote())
    from podium.compat.ray import available_resources
    cpus_before = available_resources().get("CPU")
    seconds, pids = [], [pid]
    for _ in range(args.deaths):
        started = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        new = podium.get(actor.pid.remote())
        seconds.append(time.perf_counter() - started)
        assert new != pid
        pid = new
        pids.append(pid)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids[:-1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    seconds.sort()
    print(json.dumps({
        "deaths": args.deaths,
        "death_to_answer_median_s": round(statistics.median(seconds), 3),
        "death_to_answer_p90_s": round(seconds[int(0.9 * (len(seconds) - 1))], 3),
        "death_to_answer_max_s": round(seconds[-1], 3),
        "old_processes_left": sum(1 for p in pids[:-1] if _alive(p)),
        "live_workers_named_phoenix": _live_workers("phoenix"),
        "cpus_free_before": cpus_before,
        "cpus_free_after": available_resources().get("CPU"),
    }))
    podium.shutdown()


if __name__ == "__main__":
    main()
