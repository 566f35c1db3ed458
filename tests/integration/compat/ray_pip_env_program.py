"""A Ray program using runtime_env ``pip`` (run under ``podium run`` by test_pip_env.py): argv is
a requirements.txt (for ``ray.init``), a second wheel, and a path that is no package."""

import os
import sys

import ray

REQUIREMENTS, OTHER_WHEEL, MISSING = sys.argv[1:4]


@ray.remote(num_cpus=1)
class Probe:
    def where(self):
        import podium_pipdemo
        return f"{podium_pipdemo.VALUE} {sys.prefix}"

    def child(self):
        # Created here with no runtime_env: inherits this actor's (Ray's rule).
        return ray.get(Probe.remote().where.remote())


@ray.remote(num_cpus=1)
def task_where():
    import podium_pipdemo
    return f"{podium_pipdemo.VALUE} {sys.prefix}"


ray.init(runtime_env={"pip": REQUIREMENTS})  # every actor and task of the job inherits it
try:
    import podium_pipdemo  # noqa: F401
    print("driver: has it")  # Ray does not install into the driver either
except ImportError:
    print("driver: without it")
print("job default:", ray.get(Probe.remote().where.remote()))
# Two actors asking for one new set at the same moment, a task asking for it in the dict form.
other = {"pip": [OTHER_WHEEL]}
pair = [Probe.options(runtime_env=other).remote() for _ in range(2)]
print("pair:", ray.get([actor.where.remote() for actor in pair]))
print("task:", ray.get(task_where.options(runtime_env={"pip": {"packages": [OTHER_WHEEL], "pip_check": False}}).remote()))
print("child:", ray.get(pair[0].child.remote()))
try:
    ray.get(Probe.options(runtime_env={"pip": [MISSING]}).remote().where.remote())
    print("missing: no error")
except ray.exceptions.RayActorError as exc:
    print("missing:", f"{type(exc).__name__}: {exc}".replace("\n", " | "))
try:
    Probe.options(runtime_env={"pip": [OTHER_WHEEL], "py_executable": sys.executable}).remote()
    print("both: no error")
except ValueError as exc:
    print("both:", str(exc).replace("\n", " | "))
cache = os.path.dirname(ray.get(task_where.remote()).split()[1])
print("cache:", sorted(name for name in os.listdir(cache) if os.path.isdir(os.path.join(cache, name))))
print("PIP ENV OK")
