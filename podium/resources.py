"""The resource model every Podium component agrees on (pure: no gRPC, no I/O, no clock).

Amounts travel on the wire as the numbers a user writes (``{"CPU": 3, "GPU": 1}``,
``num_gpus = 1/3``). Before any arithmetic they become exact integers:

* ``GPU_UNITS`` units per whole GPU. 720720 is the least common multiple of 1..16, so
  1/2, 1/3, ... 1/16 of a GPU are whole numbers of units and k workers of 1/k fill a GPU
  exactly: no float is ever summed, so nothing drifts after millions of reservations.
* ``CPU_UNITS`` units per logical CPU (CPU is a node-level pool, milli-CPU is plenty).

This module also owns the worker environment Podium sets (:func:`system_env`), the
names a user may not override (:data:`SYSTEM_ENV_KEYS`, :func:`check_user_env`), and
the node ordering that decides rank order (:func:`sort_key_address`).
"""

from __future__ import annotations

import enum
import functools
import ipaddress
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from podium.errors import InvalidSpecError

__all__ = [
    "GPU_UNITS", "CPU_UNITS", "CUSTOM_UNITS", "gpu_units", "cpu_units", "custom_units", "format_gpus",
    "format_cpus", "format_custom", "parse_custom_resources", "MAX_CUSTOM_RESOURCES", "MAX_CUSTOM_AMOUNT",
    "Strategy", "BundleSpec", "validate_bundles", "SYSTEM_ENV_KEYS", "check_user_env", "check_env_entries",
    "system_env", "sort_key_address",
]

#: Units per whole GPU: lcm(1..16), so every fraction 1/k with k <= 16 is exact.
GPU_UNITS = 720720
#: Units per logical CPU.
CPU_UNITS = 1000
#: Units per one of a custom resource (``{"nvlink_domain_0": 1}``, ``memory``): Ray's
#: precision for fractional resources is 0.0001.
CUSTOM_UNITS = 10000
#: Most custom resource names one node offers or one bundle asks for.
MAX_CUSTOM_RESOURCES = 64
#: Largest amount of one custom resource (``memory`` is counted in bytes: 2**50 is a PiB).
MAX_CUSTOM_AMOUNT = float(2**50)
#: Longest custom resource name.
MAX_CUSTOM_NAME = 128

# Fractions are snapped to the nearest ratio with a denominator below this, so the
# float 0.3333333333333333 means exactly 1/3 (and 0.1 exactly 1/10).
_MAX_DENOMINATOR = 10**6


def _as_fraction(x: Any, name: str) -> Fraction:
    """A finite real ``x`` as a snapped Fraction, or InvalidSpecError naming ``name``."""
    # bool is an int subclass; {"GPU": True} is a typo, not one GPU.
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise InvalidSpecError(f"{name} must be a number, got {x!r}")
    try:
        as_float = float(x)
    except (OverflowError, ValueError):  # a huge int or Fraction
        raise InvalidSpecError(f"{name} = {x!r} is not a finite number") from None
    if not math.isfinite(as_float):
        raise InvalidSpecError(f"{name} = {x!r} is not a finite number")
    exact = Fraction(x) if isinstance(x, numbers.Rational) else Fraction(as_float)
    return exact.limit_denominator(_MAX_DENOMINATOR)


# Amounts repeat (a cluster has few distinct ones) and are converted on every bundle and on
# every GPU of every /v1/placement page: the Fraction arithmetic is cached. ``typed`` keeps
# True apart from 1 (a bool is refused, an int is not).
@functools.lru_cache(maxsize=4096, typed=True)
def gpu_units(x: float, *, name: str = "GPU") -> int:
    """Convert a user GPU amount to exact integer units.

    Valid amounts are a fraction in (0, 1] or a whole number >= 1; anything else
    (NaN, inf, <= 0, 1.5) raises :class:`InvalidSpecError` naming the value.
    ``gpu_units(1/3) == 240240`` and ``3 * gpu_units(1/3) == GPU_UNITS``.
    A fraction whose denominator does not divide GPU_UNITS (1/17) is rounded
    *down* (never to zero) so that k workers of 1/k still fit on one GPU.
    """
    frac = _as_fraction(x, name)
    if frac <= 0:
        raise InvalidSpecError(f"{name} = {x!r}: a GPU amount must be > 0")
    if frac > 1 and frac.denominator != 1:
        raise InvalidSpecError(
            f"{name} = {x!r}: a GPU amount above 1 must be a whole number of GPUs "
            "(a fraction in (0, 1] or 1, 2, 3, ...)")
    return max(1, math.floor(frac * GPU_UNITS))


@functools.lru_cache(maxsize=4096, typed=True)
def cpu_units(x: float, *, name: str = "CPU") -> int:
    """Convert a user CPU amount (finite, >= 0) to exact integer units (milli-CPUs).

    A positive amount never rounds to zero; fractions round down, so k slots of 1/k fit.
    """
    frac = _as_fraction(x, name)
    if frac < 0:
        raise InvalidSpecError(f"{name} = {x!r}: a CPU amount must be >= 0")
    if frac == 0:
        return 0
    return max(1, math.floor(frac * CPU_UNITS))


@functools.lru_cache(maxsize=4096, typed=True)
def custom_units(x: float, *, name: str) -> int:
    """Convert an amount of the custom resource ``name`` (finite, in [0, MAX_CUSTOM_AMOUNT]) to
    exact integer units; as for CPUs a positive amount never rounds to zero."""
    frac = _as_fraction(x, name)
    if frac < 0 or frac > MAX_CUSTOM_AMOUNT:
        raise InvalidSpecError(f"{name} = {x!r}: a resource amount must be in [0, {MAX_CUSTOM_AMOUNT:.0f}]")
    if frac == 0:
        return 0
    return max(1, math.floor(frac * CUSTOM_UNITS))


def _check_custom_name(name: Any) -> str:
    if (not isinstance(name, str) or not name or len(name) > MAX_CUSTOM_NAME or not name.isprintable()
            or any(c.isspace() for c in name) or name.upper() in _RESOURCE_NAMES
            or name.startswith(NODE_RESOURCE_PREFIX)):
        raise InvalidSpecError(
            f"resource name {name!r} must be a string of 1 to {MAX_CUSTOM_NAME} printable characters "
            f"without spaces, other than CPU, GPU (in any case) and node:<...>")
    return name


def parse_custom_resources(resources: Mapping[str, Any] | None, what: str = "resources"
                           ) -> tuple[tuple[str, int], ...]:
    """Custom resources (``{"nvlink_domain_0": 1, "memory": 2**30}``) as sorted ``(name, units)``
    pairs; zero amounts are dropped (they ask for nothing). A bad name or amount, or more than
    :data:`MAX_CUSTOM_RESOURCES` names, raises :class:`InvalidSpecError` naming it."""
    if resources is None:
        return ()
    if not isinstance(resources, Mapping):
        raise InvalidSpecError(f"{what} must be a mapping of resource name to amount, got {resources!r}")
    if len(resources) > MAX_CUSTOM_RESOURCES:
        raise InvalidSpecError(f"{what}: {len(resources)} resource names, at most {MAX_CUSTOM_RESOURCES}")
    out = []
    for name, amount in resources.items():
        units = custom_units(amount, name=f"{what}[{_check_custom_name(name)!r}]")
        if units:
            out.append((name, units))
    return tuple(sorted(out))


def format_custom(units: int) -> str:
    """Custom resource units as a short human number: ``"1"``, ``"0.250"``."""
    return _format_amount(units, CUSTOM_UNITS)


def _format_amount(units: int, per: int) -> str:
    # Whole amounts print as integers ("8"), fractions with three decimals ("0.333").
    if units % per == 0:
        return str(units // per)
    return f"{units / per:.3f}"


def format_gpus(units: int) -> str:
    """GPU units as a short human number: ``"8"``, ``"0.333"``."""
    return _format_amount(units, GPU_UNITS)


def format_cpus(units: int) -> str:
    """CPU units as a short human number: ``"16"``, ``"0.500"``."""
    return _format_amount(units, CPU_UNITS)


class Strategy(enum.IntEnum):
    """How the bundles of a placement group spread over nodes (Ray's four strategies).

    The values are those of the wire enum ``podium.v1.Strategy``.
    """

    PACK = 1
    SPREAD = 2
    STRICT_PACK = 3
    STRICT_SPREAD = 4

    @classmethod
    def parse(cls, value: "Strategy | int | str") -> "Strategy":
        """A Strategy from a member, its wire int or its name (any case).

        Unknown names or numbers (including 0, the wire's UNSPECIFIED) raise
        :class:`InvalidSpecError` listing the valid names.
        """
        if isinstance(value, cls):
            return value
        valid = ", ".join(m.name for m in cls)
        if isinstance(value, str):
            member = cls.__members__.get(value.strip().upper())
            if member is not None:
                return member
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        raise InvalidSpecError(f"unknown placement strategy {value!r} (valid: {valid})")


_RESOURCE_NAMES = ("CPU", "GPU")
#: A bundle key ``node:<node id or address>`` (amount ignored) pins the bundle to that node.
NODE_RESOURCE_PREFIX = "node:"


@dataclass(frozen=True)
class BundleSpec:
    """The resources one bundle reserves on one node, in exact units.

    ``gpu_units`` is 0 (CPU-only), a fraction of one GPU (< GPU_UNITS), or a whole
    number of GPUs (a multiple of GPU_UNITS). ``custom`` holds the other named
    resources (``nvlink_domain_0``, ``memory``), node-level pools like CPU.
    """

    cpu_units: int
    gpu_units: int
    #: Node id or address the bundle must land on (Ray's ``node:<address>`` resource); "" any.
    node: str = ""
    #: Custom resources, ``(name, CUSTOM_UNITS units)`` sorted by name, none zero.
    custom: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        for field_name in ("cpu_units", "gpu_units"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidSpecError(f"BundleSpec.{field_name} must be an int >= 0, got {value!r}")
        if self.gpu_units > GPU_UNITS and self.gpu_units % GPU_UNITS:
            raise InvalidSpecError(
                f"BundleSpec.gpu_units = {self.gpu_units}: above one GPU it must be a whole "
                f"number of GPUs (a multiple of {GPU_UNITS})")
        if not isinstance(self.custom, tuple) or any(
                not isinstance(u, int) or isinstance(u, bool) or u <= 0 for _, u in self.custom):
            raise InvalidSpecError(f"BundleSpec.custom must be a tuple of (name, units > 0), got {self.custom!r}")
        if self.cpu_units == 0 and self.gpu_units == 0 and not self.custom:
            raise InvalidSpecError("empty bundle: it reserves no CPU, no GPU and no other resource")

    @classmethod
    def from_resources(cls, resources: Mapping[str, float]) -> "BundleSpec":
        """Parse a user bundle such as ``{"CPU": 3, "GPU": 1}``.

        ``CPU``, ``GPU``, one ``node:<id or address>`` and custom resources (any other
        name, see :func:`parse_custom_resources`). ``GPU: 0`` means no GPU (as
        when a pool is built with ``use_gpu=False``); a bad name, a negative or
        NaN amount, or a bundle with no resources at all raises
        :class:`InvalidSpecError` naming the key and value.
        """
        if not isinstance(resources, Mapping):
            raise InvalidSpecError(
                f"a bundle must be a mapping like {{'CPU': 1, 'GPU': 1}}, got {resources!r}")
        nodes = [k for k in resources if isinstance(k, str) and k.startswith(NODE_RESOURCE_PREFIX)]
        if len(nodes) > 1 or (nodes and not nodes[0][len(NODE_RESOURCE_PREFIX):]):
            raise InvalidSpecError(f"bundle {dict(resources)!r}: at most one 'node:<id or address>' key, "
                                   "naming a node")
        node = nodes[0][len(NODE_RESOURCE_PREFIX):] if nodes else ""
        resources = {k: v for k, v in resources.items() if k not in nodes}
        custom = parse_custom_resources({k: v for k, v in resources.items() if k not in _RESOURCE_NAMES},
                                        what=f"bundle {dict(resources)!r}")
        if not resources:
            raise InvalidSpecError("empty bundle {}: it must reserve CPU and/or GPU")
        cpu = cpu_units(resources["CPU"], name="CPU") if "CPU" in resources else 0
        gpu = 0
        if "GPU" in resources:
            value = resources["GPU"]
            # Zero is allowed here only: it spells "no GPU"; gpu_units() rejects it.
            is_zero = (not isinstance(value, bool) and isinstance(value, numbers.Real)
                       and value == 0)
            gpu = 0 if is_zero else gpu_units(value, name="GPU")
        if cpu == 0 and gpu == 0 and not custom:
            raise InvalidSpecError(f"empty bundle {dict(resources)!r}: it reserves nothing")
        return cls(cpu_units=cpu, gpu_units=gpu, node=node, custom=custom)

    @property
    def gpus_needed(self) -> int:
        """Whole GPUs the bundle owns: 0 CPU-only, 1 for a fraction or 1.0, n for n GPUs."""
        if self.gpu_units == 0:
            return 0
        return max(1, self.gpu_units // GPU_UNITS)

    @property
    def is_fractional(self) -> bool:
        """True when the bundle takes part of one GPU (so it may share that GPU)."""
        return 0 < self.gpu_units < GPU_UNITS

    def to_resources(self) -> dict[str, float]:
        """Back to the user form ``{"CPU": float, "GPU": float}`` (both keys always, the
        custom resources, and ``node:<node>`` for a pinned bundle)."""
        out = {"CPU": self.cpu_units / CPU_UNITS, "GPU": self.gpu_units / GPU_UNITS}
        out.update((name, units / CUSTOM_UNITS) for name, units in self.custom)
        if self.node:
            out[NODE_RESOURCE_PREFIX + self.node] = 1.0
        return out

    def describe(self) -> str:
        """Short human form, e.g. ``{CPU: 1, GPU: 0.333}`` (``, nvlink_domain_0: 1`` after)."""
        extra = "".join(f", {name}: {format_custom(units)}" for name, units in self.custom)
        return f"{{CPU: {format_cpus(self.cpu_units)}, GPU: {format_gpus(self.gpu_units)}{extra}}}"


def validate_bundles(bundles: Iterable[Mapping[str, float] | BundleSpec]) -> tuple[BundleSpec, ...]:
    """Parse a list of user bundles (mappings or BundleSpecs) into BundleSpecs.

    An empty list, or any bad bundle, raises :class:`InvalidSpecError`; the message
    names the index of the bad bundle.
    """
    if isinstance(bundles, (Mapping, str, bytes)) or not isinstance(bundles, Iterable):
        raise InvalidSpecError(f"bundles must be a list of mappings, got {bundles!r}")
    out = []
    # A group's bundles are mostly alike (a verl pool: n copies of one): parse each kind once.
    parsed: dict[tuple, BundleSpec] = {}
    for i, bundle in enumerate(bundles):
        if isinstance(bundle, BundleSpec):
            out.append(bundle)
            continue
        try:
            key = tuple((k, type(v), v) for k, v in bundle.items()) if isinstance(bundle, Mapping) else None
            hash(key)
        except TypeError:
            key = None
        spec = parsed.get(key) if key is not None else None
        if spec is None:
            try:
                spec = BundleSpec.from_resources(bundle)
            except InvalidSpecError as exc:
                raise InvalidSpecError(f"bundle {i}: {exc.message}") from None
            if key is not None:
                parsed[key] = spec
        out.append(spec)
    if not out:
        raise InvalidSpecError("a placement group needs at least one bundle, got none")
    return tuple(out)


#: Variables Podium sets in every worker; a user's worker_env may not override them.
SYSTEM_ENV_KEYS: frozenset[str] = frozenset({
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES", "WG_PREFIX", "WG_BACKEND", "PODIUM_LOCAL_WORLD_SIZE",
    "RAY_LOCAL_WORLD_SIZE", "PODIUM_WORKER_ID", "PODIUM_TOKEN", "PODIUM_NODE_ADDRESS",
    # The node agent sets these to its own TLS files (podium.worker.agent.workerenv.worker_env).
    "PODIUM_TLS_CERT", "PODIUM_TLS_KEY", "PODIUM_TLS_CA",
})


def check_user_env(env: Mapping[str, str] | None) -> None:
    """Reject a user ``worker_env`` that overrides a system variable or is not str -> str.

    Raises :class:`InvalidSpecError` (a ValueError) naming every offending key, as
    verl's ``Cannot override protected system env: {...}``.
    """
    if env is None:
        return
    if not isinstance(env, Mapping):
        raise InvalidSpecError(f"worker env must be a mapping of str to str, got {env!r}")
    not_str = sorted(repr(k) for k, v in env.items()
                     if not isinstance(k, str) or not isinstance(v, str))
    if not_str:
        raise InvalidSpecError(
            f"worker env keys and values must be str; bad entries for {', '.join(not_str)}")
    check_env_entries(env, "worker env")
    protected = sorted(k for k in env if k in SYSTEM_ENV_KEYS)
    if protected:
        names = ", ".join(repr(k) for k in protected)
        raise InvalidSpecError(f"Cannot override protected system env: {{{names}}}")


def check_env_entries(env: Mapping[str, str], what: str = "env") -> None:
    """Reject environment entries the OS cannot pass to a process (InvalidSpecError naming them).

    A name must be non-empty and hold neither ``=`` nor NUL, a value no NUL: ``execve``
    cannot carry them, and a spawn that fails on them must not leave a worker behind.
    """
    for key, value in env.items():
        if not key or "=" in key or "\x00" in key:
            raise InvalidSpecError(f"{what}: variable name {key!r} must be non-empty, without '=' or NUL")
        if "\x00" in value:
            raise InvalidSpecError(f"{what}: the value of {key!r} holds a NUL byte, which no process "
                                   "environment can carry")


def system_env(*, rank: int, world_size: int, master_addr: str, master_port: int,
               gpu_indices: Sequence[int], group: str, local_world_size: int,
               worker_id: str, node_address: str) -> dict[str, str]:
    """The environment Podium sets for one worker process (docs/architecture.md, "Worker environment").

    Each worker sees only its bundle's GPUs (``CUDA_VISIBLE_DEVICES``, empty for a
    CPU-only worker), so as in verl ``LOCAL_RANK=0`` and ``LOCAL_WORLD_SIZE=1``; the
    number of this group's processes on the node is ``PODIUM_LOCAL_WORLD_SIZE`` (and
    ``RAY_LOCAL_WORLD_SIZE``, which verl's rollout code reads).
    """
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in gpu_indices),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "PODIUM_LOCAL_WORLD_SIZE": str(local_world_size),
        "RAY_LOCAL_WORLD_SIZE": str(local_world_size),
        "WG_PREFIX": group,
        "WG_BACKEND": "podium",
        "PODIUM_WORKER_ID": worker_id,
        "PODIUM_NODE_ADDRESS": node_address,
    }


def sort_key_address(address: str) -> tuple[int, int, str]:
    """Sort key ordering node addresses numerically: IPv4 first, then IPv6, then names.

    ``"10.0.0.9"`` sorts before ``"10.0.0.10"`` (verl compares strings, which puts
    .10 first). A ``host:port`` or ``[v6]:port`` suffix is ignored for the number;
    the full string breaks ties, so the order is total and stable.
    """
    host = address.strip()
    if host.startswith("[") and "]" in host:
        host = host[1:host.index("]")]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return (2, 0, address)
    return (0 if ip.version == 4 else 1, int(ip), address)
