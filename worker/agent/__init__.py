"""The node agent: one per machine (``podium node``).

- :mod:`~podium.worker.agent.service`: the NodeAgent gRPC service and the agent's main loop
  (GPU inventory, worker reports); :mod:`~podium.worker.agent.link` its registration and
  heartbeat loop with the scheduler (the load-test harness ``tests/support/simnodes.py``
  drives the same loop for simulated nodes).
  :mod:`~podium.worker.agent.config` holds its command line, :mod:`~podium.worker.agent.ports`
  the held MASTER_PORTs, :mod:`~podium.worker.agent.logtail` TailLog's file reading.
- :mod:`~podium.worker.agent.spawner`: starting, watching and stopping worker processes;
  :mod:`~podium.worker.agent.managed` (one tracked worker), :mod:`~podium.worker.agent.workerenv`
  (its argv and environment), :mod:`~podium.worker.agent.exitinfo` (log tails, exit records),
  :mod:`~podium.worker.agent.pipenv` (runtime_env pip/uv: the node's cached virtualenvs).
- :mod:`~podium.worker.agent.forkserver`: a pre-imported parent that forks workers fast.
- :mod:`~podium.worker.agent.metrics`: the agent's Prometheus metrics.

Importing it stays light (no torch): the agent must start fast on every node.
"""
