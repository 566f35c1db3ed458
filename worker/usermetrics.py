"""Application metrics (``ray.util.metrics``) of the processes a node agent started, and how
they reach the agent's ``/metrics``.

Design: each process keeps its samples in memory (:data:`STORE`, one per process: a counter's
``inc`` is a dict update under a lock, no I/O). When the agent serves ``/metrics``
(``--metrics-port``) it gives its workers ``PODIUM_METRICS_DIR``, a private folder of its own
(``<log dir>/metrics``, mode 0700). A daemon thread of each process that recorded something
writes the process's whole snapshot there as JSON at most once per :data:`FLUSH_INTERVAL`
seconds while it changed, and once more at exit: ``<worker id>.<pid>.json``, written to a
temporary name and renamed, so a scrape reads a whole snapshot or the previous one. At each
scrape the agent reads the snapshots of the workers it knows (any state: a finished task's
counts stay until the agent forgets the worker), deletes those of workers it has forgotten,
and renders every family once, its series labelled with ``worker_id`` on top of the
application's tags (series of two processes of one worker are added up; a gauge takes the
last). A process without ``PODIUM_METRICS_DIR`` (the controller, or an agent without
``--metrics-port``) keeps its samples in memory only: nothing scrapes them, as nothing
scrapes Ray's without a Prometheus server.

Files instead of an RPC: the samples outlive the process that made them until the agent
forgets the worker (a task's counter does not vanish when its pool worker is idle or gone),
and a scrape costs no call into busy workers. Every size has a bound: :data:`MAX_FAMILIES`
families and :data:`MAX_SERIES` series per process, :data:`MAX_BOUNDARIES` histogram bounds,
names and tag values of at most :data:`MAX_TEXT` characters; the agent reads at most
:data:`MAX_FILES` snapshots of at most :data:`MAX_FILE_BYTES` each.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import pathlib
import re
import threading
import time
from typing import Any, Iterable

from podium.errors import InvalidArgumentError, ResourceExhaustedError

__all__ = ["STORE", "MetricStore", "render_dir", "FLUSH_INTERVAL", "DIR_ENV"]

log = logging.getLogger(__name__)

#: The variable naming the folder of the agent's application-metric snapshots.
DIR_ENV = "PODIUM_METRICS_DIR"
#: Seconds between two snapshots of one process (when something changed).
FLUSH_INTERVAL = 1.0
MAX_FAMILIES = 1_000
MAX_SERIES = 10_000
MAX_BOUNDARIES = 100
MAX_TEXT = 1_000
MAX_FILES = 4_096
MAX_FILE_BYTES = 8 << 20

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_TAG = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_KINDS = ("counter", "gauge", "histogram")


def check_name(kind: str, value: Any, pattern: re.Pattern = _NAME) -> str:
    """``value`` if it is a valid Prometheus metric (or tag) name, else InvalidArgumentError."""
    if not isinstance(value, str) or len(value) > MAX_TEXT or not pattern.match(value):
        raise InvalidArgumentError(f"{kind} must match {pattern.pattern} (at most {MAX_TEXT} characters), "
                                   f"got {value!r}")
    return value


class MetricStore:
    """One process's application metrics: families, their series, and the snapshot writer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: name -> {"type", "help", "boundaries", "series": {labels tuple: value}}
        self._families: dict[str, dict[str, Any]] = {}
        self._series = 0
        self._changed = threading.Event()
        self._writer: threading.Thread | None = None

    def declare(self, name: str, kind: str, description: str, boundaries: Iterable[float] = ()) -> None:
        """Make family ``name`` (again: the same kind and bounds are accepted, as two
        ``Gauge("x")`` objects in Ray report one metric)."""
        check_name("a metric name", name)
        if kind not in _KINDS:
            raise InvalidArgumentError(f"metric kind must be one of {_KINDS}, got {kind!r}")
        bounds = [float(b) for b in boundaries]
        with self._lock:
            family = self._families.get(name)
            if family is not None:
                if family["type"] != kind or family["boundaries"] != bounds:
                    raise InvalidArgumentError(f"metric {name!r} is already a {family['type']} "
                                               f"with boundaries {family['boundaries']}")
                return
            if len(self._families) >= MAX_FAMILIES:
                raise ResourceExhaustedError(f"a process may declare at most {MAX_FAMILIES} metrics")
            self._families[name] = {"type": kind, "help": str(description)[:MAX_TEXT], "boundaries": bounds,
                                    "series": {}}

    def record(self, name: str, labels: dict[str, str], value: float, how: str) -> None:
        """``how``: "add" (a counter), "set" (a gauge) or "observe" (a histogram)."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            family = self._families[name]
            series = family["series"]
            if key not in series:
                if self._series >= MAX_SERIES:
                    raise ResourceExhaustedError(f"a process may record at most {MAX_SERIES} series "
                                                 f"(metric {name!r}, tags {labels})")
                self._series += 1
                bounds = family["boundaries"]
                series[key] = [[0] * (len(bounds) + 1), 0.0, 0] if how == "observe" else 0.0
            if how == "add":
                series[key] += value
            elif how == "set":
                series[key] = value
            else:
                buckets, _, _ = entry = series[key]
                index = next((i for i, b in enumerate(family["boundaries"]) if value <= b), len(buckets) - 1)
                buckets[index] += 1
                entry[1] += value
                entry[2] += 1
        self._changed.set()
        self._start_writer()

    def snapshot(self) -> dict[str, Any]:
        """The families as JSON-ready data (the snapshot file's ``families``)."""
        with self._lock:
            return {name: {"type": f["type"], "help": f["help"], "boundaries": list(f["boundaries"]),
                           "series": [[dict(key), value if f["type"] != "histogram" else
                                       [list(value[0]), value[1], value[2]]]
                                      for key, value in f["series"].items()]}
                    for name, f in self._families.items()}

    def flush(self) -> None:
        """Write this process's snapshot into ``PODIUM_METRICS_DIR`` (nothing without one)."""
        folder = os.environ.get(DIR_ENV)
        if not folder:
            return
        worker = os.environ.get("PODIUM_WORKER_ID") or "process"
        path = pathlib.Path(folder) / f"{worker}.{os.getpid()}.json"
        temporary = path.with_suffix(".tmp")
        try:
            data = json.dumps({"worker_id": worker, "pid": os.getpid(), "families": self.snapshot()})
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(data)
            os.replace(temporary, path)
        except OSError as exc:  # a full or removed folder costs the samples' export, not the caller
            log.warning("application metrics: cannot write %s: %s", path, exc)

    def _start_writer(self) -> None:
        if self._writer is not None or not os.environ.get(DIR_ENV):
            return
        with self._lock:
            if self._writer is not None:
                return
            self._writer = threading.Thread(target=self._write_loop, name="podium-metrics", daemon=True)
            self._writer.start()
        atexit.register(self.flush)

    def _write_loop(self) -> None:
        while True:
            self._changed.wait()
            self._changed.clear()
            self.flush()
            time.sleep(FLUSH_INTERVAL)  # at most one snapshot per interval, however many updates


#: This process's application metrics.
STORE = MetricStore()


def _labels(pairs: dict[str, Any]) -> str:
    def esc(value: Any) -> str:
        return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in pairs.items()) + "}" if pairs else ""


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _read(folder: pathlib.Path, known: set[str]) -> list[dict[str, Any]]:
    snapshots = []
    for count, path in enumerate(sorted(folder.glob("*.json"))):
        worker = path.name.split(".", 1)[0]
        if worker not in known:
            path.unlink(missing_ok=True)  # the agent forgot this worker: its samples go too
            continue
        if count >= MAX_FILES or path.stat().st_size > MAX_FILE_BYTES:
            log.warning("application metrics: %s skipped (more than %d files or over %d bytes)",
                        path, MAX_FILES, MAX_FILE_BYTES)
            continue
        try:
            snapshots.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            log.warning("application metrics: %s unreadable: %s", path, exc)
    return snapshots


def render_dir(folder: str | os.PathLike | None, known: set[str]) -> list[str]:
    """Prometheus text lines of the snapshots in ``folder`` of the workers in ``known``
    (deleting the others' files), one HELP/TYPE block per family."""
    if not folder or not pathlib.Path(folder).is_dir():
        return []
    merged: dict[str, dict[str, Any]] = {}
    for snap in _read(pathlib.Path(folder), known):
        worker = str(snap.get("worker_id", ""))
        for name, family in (snap.get("families") or {}).items():
            into = merged.setdefault(name, {"type": family["type"], "help": family["help"],
                                            "boundaries": family["boundaries"], "series": {}})
            if into["type"] != family["type"] or into["boundaries"] != family["boundaries"]:
                log.warning("application metrics: %s of worker %s is a %s; another worker's is a %s: skipped",
                            name, worker, family["type"], into["type"])
                continue
            for labels, value in family["series"]:
                key = tuple(sorted({**labels, "worker_id": worker}.items()))
                before = into["series"].get(key)
                if before is None or family["type"] == "gauge":
                    into["series"][key] = value
                elif family["type"] == "counter":
                    into["series"][key] = before + value
                else:
                    into["series"][key] = [[a + b for a, b in zip(before[0], value[0])],
                                           before[1] + value[1], before[2] + value[2]]
    lines = []
    for name, family in sorted(merged.items()):
        lines.append(f"# HELP {name} {family['help'] or name}".replace("\n", " "))
        lines.append(f"# TYPE {name} {family['type']}")
        for key, value in sorted(family["series"].items()):
            labels = dict(key)
            if family["type"] != "histogram":
                lines.append(f"{name}{_labels(labels)} {_num(value)}")
                continue
            buckets, total, count = value
            running = 0
            for bound, n in zip([*family["boundaries"], math.inf], buckets):
                running += n
                lines.append(f"{name}_bucket{_labels({**labels, 'le': _num(bound)})} {running}")
            lines.append(f"{name}_sum{_labels(labels)} {_num(total)}")
            lines.append(f"{name}_count{_labels(labels)} {count}")
    return lines
