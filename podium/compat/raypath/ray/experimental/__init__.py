"""``ray.experimental``: only ``ray.experimental.state.api`` (what verl reads) is provided."""

from __future__ import annotations

from podium.compat.standin import missing


def __getattr__(name: str):
    if name == "state":
        import importlib
        return importlib.import_module("ray.experimental.state")
    return missing(f"ray.experimental.{name}", "podium status / the scheduler's /v1 HTTP API")
