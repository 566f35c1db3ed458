"""How far a framework's own modules import under ``podium run`` (issue #49 item 12), from a
checkout: for each module, ``OK`` or the first line that failed in the framework's code.

Usage: python tools/framework_reach.py CHECKOUT [--framework nemo-rl|slime|roll] [MODULE ...]
(run in Podium's virtualenv; the checkout goes on PYTHONPATH, the stand-in is ``ray``). With
``--framework``, the modules are that framework's trainer/controller modules listed below.
It measures: nothing is installed and nothing in the checkout is changed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

#: Each framework's controller and trainer modules (from its entry points).
MODULES = {
    "nemo-rl": ["nemo_rl.experience.failures", "nemo_rl.distributed.virtual_cluster",
                "nemo_rl.distributed.worker_groups", "nemo_rl.algorithms.grpo"],
    "slime": ["slime.ray.placement_group", "slime.ray.rollout", "slime.ray.actor_group", "slime.utils.arguments"],
    "roll": ["roll.distributed.scheduler.driver_utils", "roll.distributed.scheduler.initialize",
             "roll.distributed.scheduler.resource_manager", "roll.pipeline.rlvr.rlvr_pipeline"],
}

PROBE = r"""
import sys, traceback
checkout = sys.argv[1]
for name in sys.argv[2:]:
    try:
        __import__(name)
        print("OK  ", name)
    except BaseException as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        own = [f for f in frames if f.filename.startswith(checkout)] or frames
        f = own[-1]
        print("FAIL", name, f"{f.filename[len(checkout):].lstrip('/')}:{f.lineno}: {f.line} -> {exc!r}"[:400])
"""


def main() -> int:
    """Print one line per module; the exit status is the number that failed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkout")
    p.add_argument("--framework", choices=sorted(MODULES))
    p.add_argument("modules", nargs="*")
    args = p.parse_args()
    checkout = os.path.realpath(args.checkout)
    modules = args.modules or MODULES.get(args.framework or "", [])
    if not modules:
        p.error("give --framework or the modules to import")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (checkout, os.environ.get("PYTHONPATH")) if x))
    run = subprocess.run([sys.executable, "-m", "podium.cli", "run", "--", sys.executable, "-c", PROBE, checkout,
                          *modules], env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in run.stdout.splitlines() if x.startswith(("OK  ", "FAIL"))]
    print("\n".join(lines) or run.stderr[-2000:])
    return sum(x.startswith("FAIL") for x in lines)


if __name__ == "__main__":
    sys.exit(main())
