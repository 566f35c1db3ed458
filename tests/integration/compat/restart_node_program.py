"""An actor whose node is lost (its node agent and its process SIGKILLed) comes back on the
other node: a Ray program run under ``podium run --address`` (test_restarts.py)."""

import os
import signal
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(max_restarts=1, max_task_retries=-1)
class Where:
    def __init__(self, tag):
        self.tag = tag

    def node(self):
        return f"{self.tag}@{os.environ.get('PODIUM_NODE_ADDRESS')}"

    def pid(self):
        return os.getpid()


def main():
    ray.init()
    victim = os.environ["VICTIM_HOST"]
    actor = Where.options(name="where", scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id=victim, soft=True)).remote("t")
    print("before:", ray.get(actor.node.remote()) == f"t@{victim}")
    pid = ray.get(actor.pid.remote())
    # The whole machine goes: its node agent, then the actor's process.
    os.kill(int(os.environ["VICTIM_AGENT_PID"]), signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    after = ray.get(actor.node.remote())
    print("after:", after.split("@")[0], after.split("@")[1] != victim)
    print("by name:", ray.get(ray.get_actor("where").node.remote()) == after)
    print(f"seconds to come back: {time.monotonic() - started:.1f}")
    print("PROGRAM OK")


if __name__ == "__main__":
    main()
