"""``ray.util.metrics``: ``Counter``, ``Gauge`` and ``Histogram`` with Ray's signatures (a bad
argument raises ``InvalidArgumentError``, a ``ValueError``, or ``ArgumentMismatchError``, a
``TypeError``, where Ray raises those), recorded
in this process (:data:`podium.worker.usermetrics.STORE`) and exported on the ``/metrics`` of
the node agent that started it (see :mod:`podium.worker.usermetrics` for the path and its
bounds); each series carries its tags and ``worker_id``."""

from __future__ import annotations

import math
from typing import Any

from podium.errors import ArgumentMismatchError, InvalidArgumentError
from podium.worker.usermetrics import _TAG, MAX_BOUNDARIES, MAX_TEXT, STORE, check_name

__all__ = ["Counter", "Gauge", "Histogram", "Metric"]


class Metric:
    """What the three kinds share: a name, a description, the tag keys every sample gives a
    value for (or that :meth:`set_default_tags` fills in)."""

    _kind = ""

    def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] | None = None,
                 _boundaries: list[float] | None = None) -> None:
        if not name:
            raise InvalidArgumentError("Empty name is not allowed. Please provide a metric name.")
        if tag_keys is not None and not isinstance(tag_keys, (tuple, list)):
            raise ArgumentMismatchError(f"tag_keys should be a tuple type, got: {type(tag_keys)}")
        self._name = check_name("a metric name", name)
        self._description = description
        self._tag_keys = tuple(check_name("a tag key", k, _TAG) for k in (tag_keys or ()))
        self._default_tags: dict[str, str] = {}
        STORE.declare(self._name, self._kind, description, _boundaries or ())

    def set_default_tags(self, default_tags: dict[str, str]) -> Metric:
        """Tag values used when a sample does not give its own (Ray's ``set_default_tags``)."""
        for key, value in default_tags.items():
            if key not in self._tag_keys:
                raise InvalidArgumentError(f"Unrecognized tag key {key}.")
            if not isinstance(value, str):
                raise ArgumentMismatchError(f"Tag values must be str, got {type(value)}.")
        self._default_tags = dict(default_tags)
        return self

    def _tags(self, tags: dict[str, str] | None) -> dict[str, str]:
        final = {**self._default_tags, **(tags or {})}
        unknown = sorted(set(final) - set(self._tag_keys))
        if unknown:
            raise InvalidArgumentError(f"Unrecognized tag keys: {unknown}; this metric's tag_keys are "
                                       f"{self._tag_keys}")
        missing = [k for k in self._tag_keys if k not in final]
        if missing:
            raise InvalidArgumentError(f"Missing value for tag key(s): {','.join(missing)}.")
        for key, value in final.items():
            if not isinstance(value, str) or len(value) > MAX_TEXT:
                raise ArgumentMismatchError(f"Tag value of {key!r} must be a str of at most {MAX_TEXT} "
                                            f"characters, got {value!r}")
        return final

    @property
    def info(self) -> dict[str, Any]:
        """Name, description, tag keys and default tags (Ray's ``Metric.info``)."""
        return {"name": self._name, "description": self._description, "tag_keys": self._tag_keys,
                "default_tags": dict(self._default_tags)}


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ArgumentMismatchError(f"a metric value must be a number, got {value!r}")
    return float(value)


class Counter(Metric):
    """``ray.util.metrics.Counter(name, description="", tag_keys=None)``: a cumulative count."""

    _kind = "counter"

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        """Add ``value`` (> 0) to the series of ``tags``."""
        amount = _number(value)
        if amount <= 0:
            raise InvalidArgumentError(f"value must be >0, got {value}")
        STORE.record(self._name, self._tags(tags), amount, "add")


class Gauge(Metric):
    """``ray.util.metrics.Gauge(name, description="", tag_keys=None)``: a value that goes up and down."""

    _kind = "gauge"

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        """Make ``value`` the series of ``tags`` (None: no change, as in Ray)."""
        if value is None:
            return
        STORE.record(self._name, self._tags(tags), _number(value), "set")


class Histogram(Metric):
    """``ray.util.metrics.Histogram(name, description="", boundaries=None, tag_keys=None)``:
    observations counted in buckets whose upper bounds are ``boundaries`` (then +Inf)."""

    _kind = "histogram"

    def __init__(self, name: str, description: str = "", boundaries: list[float] | None = None,
                 tag_keys: tuple[str, ...] | None = None) -> None:
        if not boundaries:
            raise InvalidArgumentError("boundaries argument should be provided when using the Histogram class. "
                                       "e.g., Histogram(\"name\", boundaries=[1.0, 2.0])")
        if len(boundaries) > MAX_BOUNDARIES:
            raise InvalidArgumentError(f"a histogram may have at most {MAX_BOUNDARIES} boundaries, "
                                       f"got {len(boundaries)}")
        for i, bound in enumerate(boundaries):
            if _number(bound) <= 0 or math.isinf(bound):
                raise InvalidArgumentError(f"Invalid `boundaries` argument at index {i}, {bound}. "
                                           "Use positive values for the arguments.")
        if list(boundaries) != sorted(boundaries):
            raise InvalidArgumentError(f"boundaries must be increasing, got {boundaries}")
        self.boundaries = [float(b) for b in boundaries]
        super().__init__(name, description, tag_keys, _boundaries=self.boundaries)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        """Count ``value`` in its bucket of the series of ``tags``."""
        STORE.record(self._name, self._tags(tags), _number(value), "observe")

    @property
    def info(self) -> dict[str, Any]:
        """As :attr:`Metric.info`, with ``boundaries``."""
        return {**super().info, "boundaries": self.boundaries}
