"""``ray.cloudpickle``: the cloudpickle package (Ray vendors a copy; Podium uses the real one)."""

from __future__ import annotations

from cloudpickle import *
from cloudpickle import dump, dumps, load, loads  # noqa: F401
