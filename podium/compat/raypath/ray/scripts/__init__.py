"""``ray.scripts``: the module of Ray's command line whose ``memory_summary`` programs call
(NeMo-RL's memory tracker); the ``ray`` command itself is :mod:`podium.compat.raycli`."""
