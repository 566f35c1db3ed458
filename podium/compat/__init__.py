"""Compatibility layers that let code written for another framework run on Podium.

- :mod:`podium.compat.ray`: ``import podium.compat.ray as ray`` runs Ray-style code (init,
  get/put/wait, remote tasks and actors, placement groups) on a Podium cluster.

This is the top layer: it may import :mod:`podium.controller`, nothing imports it.
"""
