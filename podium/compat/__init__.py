"""Compatibility layers that let code written for another framework run on Podium.

- :mod:`podium.compat.ray`: ``import podium.compat.ray as ray`` runs Ray-style code (init,
  get/put/wait, remote tasks and actors, placement groups) on a Podium cluster.
- ``podium/compat/raypath/ray``: a ``ray`` package tree over it, for code that says
  ``import ray`` and cannot be edited (verl): ``podium run -- COMMAND`` or :func:`activate`
  make ``import ray`` find it (:mod:`podium.compat.standin` holds what it adds,
  :mod:`podium.compat.collective` its ``ray.util.collective``).

This is the top layer: it may import :mod:`podium.controller`, nothing imports it.
"""

from podium.compat.activation import activate

__all__ = ["activate"]
