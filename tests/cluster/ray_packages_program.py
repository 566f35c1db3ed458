"""A Ray program whose runtime_env names packages uploaded to the cluster (run under ``podium
run --address`` by test_runtime_env_packages.py): argv is the working_dir package, the
py_modules package and a package that was never uploaded."""

import os
import sys

import ray

WORKING_DIR, MODULE, MISSING = sys.argv[1:4]


@ray.remote(num_cpus=1)
class Probe:
    def where(self):
        import wd_module  # from the working_dir package
        import pkg_module  # from the py_modules package (ray.init's)
        return f"{os.path.basename(os.getcwd())} {wd_module.VALUE + pkg_module.VALUE} {ray.get_runtime_context().get_node_id()}"


@ray.remote(num_cpus=1)
def task_where():
    import pkg_module
    return pkg_module.VALUE


ray.init(runtime_env={"py_modules": [MODULE]})  # every actor and task of the job inherits it
print("task:", ray.get(task_where.remote()))
actors = [Probe.options(runtime_env={"working_dir": WORKING_DIR}).remote() for _ in range(4)]
print("actors:", sorted(set(ray.get([a.where.remote() for a in actors]))))
try:
    ray.get(Probe.options(runtime_env={"working_dir": MISSING}).remote().where.remote())
    print("missing: no error")
except ray.exceptions.RayActorError as exc:
    print("missing:", f"{type(exc).__name__}: {exc}".replace("\n", " | "))
try:
    Probe.options(runtime_env={"working_dir": "s3://bucket/pkg.zip"}).remote()
    print("s3: no error")
except NotImplementedError as exc:
    print("s3:", str(exc).replace("\n", " | "))
print("PACKAGES OK")
