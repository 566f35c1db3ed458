"""The ``podium`` command: one entry point, one subcommand per process role.

Each subcommand lives with the code it runs and is imported only when used,
so ``podium node`` never imports torch and ``podium --help`` starts fast.
"""

from __future__ import annotations

import importlib
import sys

#: subcommand -> ("module:function", one-line help). Each function takes argv.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "scheduler": ("podium.scheduler.server:main", "run the cluster scheduler service"),
    "node": ("podium.worker.agent.service:main", "run a node agent on this machine"),
    "worker": ("podium.worker.host.process:main", "run one worker process (started by a node agent)"),
    "up": ("podium.cli.operator:main_up", "start a local multi-node cluster (loopback addresses)"),
    "status": ("podium.cli.operator:main_status", "show nodes, GPUs, placement groups and workers"),
    "logs": ("podium.cli.operator:main_logs", "print (or --follow) a worker's output"),
    "stack": ("podium.cli.operator:main_stack", "print the Python stack of every thread of live workers"),
    "down": ("podium.cli.operator:main_down", "stop the local cluster started by `podium up`"),
    "slurm": ("podium.cli.slurm:main", "inside a Slurm allocation: start a cluster, run a controller, stop all"),
    "run": ("podium.cli.run:main", "run a program with `import ray` resolving to Podium (verl unmodified)"),
    "job": ("podium.cli.job:main", "submit, follow, stop and list jobs on a cluster (`ray job`'s flags)"),
}


def main(argv: list[str] | None = None) -> int:
    """Run ``podium <subcommand> ...``; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        width = max(map(len, SUBCOMMANDS))
        lines = [f"  {name:<{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items()]
        print("usage: podium <command> [options]\n\ncommands:\n" + "\n".join(lines))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"podium: unknown command {name!r} (try: {', '.join(SUBCOMMANDS)})", file=sys.stderr)
        return 2
    module_name, func_name = SUBCOMMANDS[name][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
