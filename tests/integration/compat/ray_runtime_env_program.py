"""A Ray program using runtime_env (run under ``podium run`` by test_runtime_env.py): argv is
the wrapped interpreter command, an interpreter without Podium, a working_dir and a module."""

import os
import sys

import ray
from ray.runtime_env import RuntimeEnv
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

WRAPPED, NO_PODIUM, WORKING_DIR, MODULE = sys.argv[1:5]


@ray.remote(num_cpus=1)
class Probe:
    def where(self):
        return {"exe": sys.executable, "flag": os.environ.get("PODIUM_TEST_WRAPPED", ""), "cwd": os.getcwd()}

    def child_exe(self):
        # Created here with no runtime_env: inherits this actor's (Ray's rule).
        child = Probe.remote()
        return ray.get(child.where.remote())["exe"]

    def imports(self):
        import wd_module  # from working_dir
        import extra_pkg  # from py_modules
        return wd_module.VALUE + extra_pkg.VALUE


@ray.remote(num_cpus=1)
def task_exe():
    return sys.executable


def failure(env):
    try:
        actor = Probe.options(runtime_env=env).remote()
        ray.get(actor.where.remote())
    except ray.exceptions.RayActorError as exc:
        return f"{type(exc).__name__}: {exc}".replace("\n", " | ")
    return "no error"


ray.init()
pg = placement_group([{"CPU": 1}, {"CPU": 1}])
ray.get(pg.ready())
wrapped = Probe.options(runtime_env=RuntimeEnv(py_executable=WRAPPED), scheduling_strategy=
                        PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)).remote()
plain = Probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1)).remote()
print("wrapped:", ray.get(wrapped.where.remote()))
print("plain:", ray.get(plain.where.remote()))
print("child:", ray.get(wrapped.child_exe.remote()))
print("task:", ray.get(task_exe.options(runtime_env={"py_executable": WRAPPED}).remote()))
with_dirs = Probe.options(runtime_env={"working_dir": WORKING_DIR, "py_modules": [MODULE]}).remote()
print("dirs:", ray.get(with_dirs.where.remote())["cwd"], ray.get(with_dirs.imports.remote()))
print("missing:", failure({"py_executable": "/nonexistent/bin/python3"}))
broken = f"{sys.executable} -c 'import sys; sys.stderr.write(\"interpreter-broken\\n\"); sys.exit(3)'"
print("broken:", failure({"py_executable": broken}))
print("no podium:", failure({"py_executable": NO_PODIUM}))
print("RUNTIME ENV OK")
