"""``ray.util.metrics``: ``Counter``, ``Gauge``, ``Histogram`` (:mod:`podium.compat.metrics`),
exported on the ``/metrics`` of the node agent that started this process."""

from __future__ import annotations

from podium.compat.metrics import Counter, Gauge, Histogram, Metric
from podium.compat.standin import missing

__all__ = ["Counter", "Gauge", "Histogram", "Metric"]


def __getattr__(name: str):
    return missing(f"ray.util.metrics.{name}", "Counter, Gauge or Histogram")
