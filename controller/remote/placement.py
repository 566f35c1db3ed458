"""Ray's placement group API (``ray.util.placement_group`` and friends) over the scheduler's
placement groups, for actors and tasks placed in a bundle
(``PlacementGroupSchedulingStrategy``). WorkerGroups keep using ResourcePool.

``placement_group(bundles, strategy)`` asks the scheduler at once and returns; ``pg.ready()``
is a ref that resolves (to True) once every bundle is placed, ``pg.wait(timeout)`` waits.
A non-detached group is removed with this controller's session, or by
:func:`remove_placement_group`.
"""

from __future__ import annotations

import math
import os
import secrets
from typing import Any

from podium.controller.remote.actoroptions import CURRENT_PG_ENV
from podium.controller.session.runtime import get_runtime
from podium.errors import InvalidArgumentError, InvalidSpecError, NotFoundError, UnimplementedError
from podium.resources import parse_custom_resources

__all__ = ["PlacementGroup", "placement_group", "remove_placement_group", "get_placement_group",
           "get_current_placement_group", "MAX_BUNDLES"]

#: Most bundles one placement group may ask for.
MAX_BUNDLES = 4096
_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class PlacementGroup:
    """A placement group: ``id``, ``bundle_specs``, ``bundle_count``, ``ready()``, ``wait()``."""

    def __init__(self, info: Any) -> None:
        self._info = info

    @property
    def id(self) -> str:
        """The scheduler's id ("pg-...")."""
        return self._info.id

    @property
    def name(self) -> str:
        """Its cluster-unique name."""
        return self._info.name

    @property
    def bundle_specs(self) -> list[dict[str, float]]:
        """The requested bundles, in order."""
        return [dict(b.resources) for b in self._info.bundles]

    @property
    def bundle_count(self) -> int:
        """How many bundles it has."""
        return len(self._info.bundles)

    def ready(self) -> Any:
        """A ref that resolves to True once every bundle is placed (``get``/``wait`` it)."""
        from podium import codec
        from podium.controller.session.futures import PendingRef
        from podium.refs import ObjectRef

        rt = get_runtime()
        ref = PendingRef(-1, "placement_group.ready")
        inline = b"".join(codec.encode(True).to_segments())

        async def wait() -> None:
            try:
                self._info = await rt.scheduler.wait_placement_group(self.id, timeout=rt.placement_timeout)
            except BaseException as exc:  # noqa: BLE001 - reported through the ref
                ref.set_exception(exc)
            else:
                ref.set_result(ObjectRef(f"ready:{self.id}", "", "", -1, len(inline), -1, inline))

        rt.submit(wait())
        return ref

    def wait(self, timeout_seconds: float = 30) -> bool:
        """Wait up to ``timeout_seconds`` for the placement; False when it ran out."""
        from podium.errors import DeadlineExceededError

        if not isinstance(timeout_seconds, (int, float)) or not 0 <= timeout_seconds <= 86400:
            raise InvalidArgumentError(f"timeout_seconds must be in [0, 86400], got {timeout_seconds!r}")
        rt = get_runtime()
        try:
            self._info = rt.run(rt.scheduler.wait_placement_group(self.id, timeout=timeout_seconds),
                                timeout=timeout_seconds + 10, what="placement group wait")
        except DeadlineExceededError:
            return False
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PlacementGroup) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"PlacementGroup(id={self.id!r}, name={self.name!r}, bundles={self.bundle_specs})"


def _check_bundles(bundles: Any) -> list[dict[str, float]]:
    if not isinstance(bundles, (list, tuple)) or not 1 <= len(bundles) <= MAX_BUNDLES:
        raise InvalidArgumentError(f"bundles must be a list of 1 to {MAX_BUNDLES} dicts")
    out = []
    for i, bundle in enumerate(bundles):
        if not isinstance(bundle, dict) or not bundle:
            raise InvalidArgumentError(f"bundle {i} must be a non-empty dict of resources, got {bundle!r}")
        try:  # custom resources: the names and counts the scheduler accepts
            parse_custom_resources({k: v for k, v in bundle.items()
                                    if k not in ("CPU", "GPU") and not str(k).startswith("node:")},
                                   what=f"bundle {i}")
        except InvalidSpecError as exc:
            raise InvalidArgumentError(exc.message) from None
        for key, value in bundle.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise InvalidArgumentError(f"bundle {i}: {key} must be a number >= 0, got {value!r}")
        out.append({k: float(v) for k, v in bundle.items()})
    return out


#: Ray's placement_group keywords Podium does not provide (None asks for nothing), and what to use.
_REFUSED = {
    "bundle_label_selector": "`podium node` per kind of machine and a placement group per kind",
    "_soft_target_node_id": "NodeAffinitySchedulingStrategy(soft=True) for the group's workers",
    "topology_strategy": "STRICT_PACK (one node) or a NodeAffinitySchedulingStrategy",
}


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse Ray's keywords Podium does not provide (unless None) and unknown ones."""
    for key, value in kwargs.items():
        if key in _REFUSED and value not in (None, [], ()):
            raise UnimplementedError(f"placement_group({key}={value!r}) is not supported by Podium: {_REFUSED[key]}")
    # _max_cpu_fraction_per_node: removed from Ray; it limited what Ray's daemons could not use.
    unknown = sorted(set(kwargs) - {"_max_cpu_fraction_per_node", *_REFUSED})
    if unknown:
        raise InvalidArgumentError(f"unknown placement_group arguments {unknown}")


def placement_group(bundles: list[dict[str, float]], strategy: str = "PACK", name: str = "",
                    lifetime: str | None = None, **kwargs: Any) -> PlacementGroup:
    """Reserve ``bundles`` with ``strategy`` (Ray's four); returns before they are placed."""
    if strategy not in _STRATEGIES:
        raise InvalidArgumentError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}")
    if lifetime not in (None, "detached"):
        raise InvalidArgumentError(f"lifetime must be None or 'detached', got {lifetime!r}")
    _check_kwargs(kwargs)
    checked = _check_bundles(bundles)
    rt = get_runtime()
    detached = lifetime == "detached"
    info = rt.run(rt.scheduler.create_placement_group(
        name or f"pg-{secrets.token_hex(6)}", checked, strategy, detached=detached,
        owner="" if detached else rt.session_id), timeout=60, what="create placement group")
    return PlacementGroup(info)


def remove_placement_group(pg: PlacementGroup) -> None:
    """Remove ``pg``; the workers in it stop. A resource pool's own placement groups
    (``pool.pgs``, the scheduler's records) are accepted too."""
    pg_id = getattr(pg, "id", None)
    if not isinstance(pg_id, str) or not pg_id:
        raise InvalidArgumentError(f"remove_placement_group takes a PlacementGroup, got {type(pg).__name__}")
    rt = get_runtime()
    rt.run(rt.scheduler.remove_placement_group(pg_id), timeout=60, what="remove placement group")


def get_placement_group(name: str) -> PlacementGroup:
    """The placement group called ``name`` (NotFoundError when there is none)."""
    rt = get_runtime()
    try:
        info = rt.run(rt.scheduler.get_placement_group(name=name), timeout=60, what="get placement group")
    except NotFoundError:
        raise NotFoundError(f"no placement group named {name!r}") from None
    return PlacementGroup(info)


def get_current_placement_group() -> PlacementGroup | None:
    """Ray's ``get_current_placement_group``: inside an actor or task placed in a placement
    group, that group; None elsewhere (the driver, an actor with a bundle of its own)."""
    pg_id = os.environ.get(CURRENT_PG_ENV)
    if not pg_id:
        return None
    rt = get_runtime()
    info = rt.run(rt.scheduler.get_placement_group(pg_id), timeout=60, what="get current placement group")
    return PlacementGroup(info)
