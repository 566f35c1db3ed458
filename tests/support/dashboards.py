"""The Grafana dashboard in deploy/grafana and the metric names its PromQL queries read.

:func:`metric_names` takes the names out of a PromQL expression: strings, label matchers
(``{...}``), range and subquery selectors (``[...]``) and ``by``/``without``/``on``/
``ignoring``/``group_left``/``group_right`` label lists go first; what is left that is an
identifier, not followed by ``(`` (a function or aggregation) and not a keyword, names a
series. :func:`exported_series` turns families into the series names Prometheus sees
(a histogram ``X`` is ``X_bucket``, ``X_sum`` and ``X_count``); :func:`sample_names`
reads them from a real scrape.
"""

from __future__ import annotations

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "podium-dashboard.json"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
             "unless", "inf", "nan", "atan2"}
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.$:])([A-Za-z_:][\w:]*)(\s*\()?")


def load() -> dict:
    """The dashboard, parsed."""
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict) -> list[str]:
    """Every PromQL expression in it: the panels' targets and the query variables'."""
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            # label_values(metric, label): the metric is the query's series
            match = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query)
            exprs.append(match.group(1) if match else query)
    return exprs


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads."""
    text = _STRINGS.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def exported_series(families: dict[str, str]) -> set[str]:
    """Series names of ``families`` (name -> Prometheus type)."""
    out = set()
    for name, kind in families.items():
        if kind == "histogram":
            out |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif kind == "summary":
            out |= {name, f"{name}_sum", f"{name}_count"}
        elif kind == "counter":  # prometheus_client names the family without its _total
            out.add(name if name.endswith("_total") else f"{name}_total")
        else:
            out.add(name)
    return out


def sample_names(text: str) -> set[str]:
    """The series names that have at least one sample in a Prometheus text exposition."""
    return {m.group(1) for m in re.finditer(r"^([A-Za-z_:][\w:]*)[{ ]", text, re.M)}
