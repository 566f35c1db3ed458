"""Run under ``podium run --address ...`` with ``METRICS_URL`` (a node agent's /metrics) set:
an actor and a task record ``ray.util.metrics`` samples with plain ``import ray``; this
driver scrapes the agent until they show, prints the application's lines and
``METRICS OK``."""

from __future__ import annotations

import os
import time
import urllib.request

import ray
from ray.util.metrics import Counter, Gauge, Histogram


@ray.remote
class Trainer:
    """Records the three kinds, as SkyRL's trainer and vLLM's engines do."""

    def __init__(self) -> None:
        self.steps = Counter("app_steps", description="training steps", tag_keys=("phase",))
        self.steps.set_default_tags({"phase": "train"})
        self.phase = Gauge("app_phase", description="1 while in a phase", tag_keys=("phase",))
        self.latency = Histogram("app_step_seconds", description="step time", boundaries=[0.1, 1.0, 10.0],
                                 tag_keys=("phase",))

    def step(self, n: int) -> None:
        for _ in range(n):
            self.steps.inc()
        self.steps.inc(2.0, tags={"phase": "eval"})
        self.phase.set(1.0, tags={"phase": "train"})
        self.phase.set(0.0, tags={"phase": "eval"})
        for seconds in (0.05, 0.5, 5.0, 50.0):
            self.latency.observe(seconds, tags={"phase": "train"})

    def refused(self) -> list[str]:
        out = []
        for bad in (lambda: self.steps.inc(-1), lambda: self.steps.inc(tags={"stage": "x"}),
                    lambda: Histogram("app_no_bounds"), lambda: Gauge("bad name")):
            try:
                bad()
            except (ValueError, TypeError) as exc:
                out.append(type(exc).__name__)
        return out


@ray.remote
def a_task() -> None:
    Counter("app_task_runs", description="tasks run").inc()


trainer = Trainer.remote()
ray.get(trainer.step.remote(3))
assert ray.get(trainer.refused.remote()) == ["InvalidArgumentError"] * 4  # ValueErrors, as in Ray
ray.get(a_task.remote())

want = ['app_steps{phase="train",worker_id=', 'app_steps{phase="eval",worker_id=', "app_phase{",
        'app_step_seconds_bucket{phase="train",worker_id=', "app_step_seconds_count{", "app_task_runs{"]
request = urllib.request.Request(os.environ["METRICS_URL"],
                                 headers={"Authorization": f"Bearer {os.environ['PODIUM_TOKEN']}"})
deadline = time.monotonic() + 60  # the workers write a snapshot within a second of a change
while True:
    with urllib.request.urlopen(request, timeout=30) as reply:
        text = reply.read().decode()
    if all(w in text for w in want) or time.monotonic() > deadline:
        break
    time.sleep(0.2)
for line in text.splitlines():
    if line.startswith(("app_", "# TYPE app_")):
        print(line)
print("METRICS OK")
