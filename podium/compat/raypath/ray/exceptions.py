"""``ray.exceptions``: every class of Ray 2.60's module (:mod:`podium.compat.rayexceptions`);
those Podium raises are Podium's own classes (``ActorDiedError`` is ``WorkerDiedError``)."""

from __future__ import annotations

from podium.compat.rayexceptions import *  # noqa: F403 - the module is the list of Ray's names
from podium.compat.rayexceptions import NAMES as _NAMES
from podium.compat.rayexceptions import OLDER_NAMES as _OLDER_NAMES
from podium.compat.standin import missing

__all__ = [*_NAMES, *_OLDER_NAMES, "RAY_EXCEPTION_TYPES"]


def __getattr__(name: str):
    return missing(f"ray.exceptions.{name}", "the podium.errors classes listed in ray.exceptions.__all__")
