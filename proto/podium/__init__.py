"""Podium: a gRPC control plane for single-controller RL post-training.

The import root of every part: ``podium`` (shared protocol: DataProto, codec,
errors, resources), ``podium.scheduler``, ``podium.worker`` and
``podium.controller``. See DESIGN.md for the map.
"""

__version__ = "0.1.0"
