"""The ``podium`` command line and the local cluster (the top layer: it may import everything).

``podium <subcommand>`` dispatches to the module that runs each process role
(:mod:`podium.cli.main`); ``podium up/down/status/logs`` are the operator's commands
(:mod:`podium.cli.operator`, :mod:`podium.cli.localcluster`, :mod:`podium.cli.status_table`);
``python -m podium.cli.healthprobe`` is the container health check.
"""

from podium.cli.main import SUBCOMMANDS, main

__all__ = ["SUBCOMMANDS", "main"]
