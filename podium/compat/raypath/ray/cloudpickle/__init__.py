"""``ray.cloudpickle``: the cloudpickle package (Ray vendors a copy; Podium uses the real one).

As in Ray's copy, ``ray.cloudpickle.pickle`` is the standard library's :mod:`pickle` (verl's
tests time ``ray.cloudpickle.pickle.dumps``)."""

from __future__ import annotations

import pickle  # noqa: F401 - Ray's ray.cloudpickle exports it

from cloudpickle import *
from cloudpickle import dump, dumps, load, loads  # noqa: F401
