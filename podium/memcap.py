"""The opt-in GPU memory cap: how it is asked for and how it travels (pure, no torch).

Ray and verl treat ``num_gpus=1/3`` as bookkeeping: three processes on one GPU can each
take all of its memory. A pool or group built with ``gpu_memory_cap=...`` (see
:func:`cap_env`) puts one of two variables in each worker's environment:

* ``PODIUM_GPU_MEMORY_CAP_FRACTION``: a fraction in (0, 1] of each visible GPU's memory;
* ``PODIUM_GPU_MEMORY_CAP_BYTES``: a byte limit per visible GPU.

The worker host applies them before user code (:mod:`podium.worker.host.gpucap`); the
scheduler's ``/v1/placement`` shows the cap of each worker (:func:`requested_cap`) beside
the memory NVML sees it use.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from podium.errors import InvalidArgumentError

__all__ = ["FRACTION_ENV", "BYTES_ENV", "MIN_CAP_BYTES", "MAX_CAP_BYTES", "CapReport", "cap_env",
           "group_env", "parse_env", "requested_cap", "gib_text", "fraction_words"]

#: Environment variable: the cap as a fraction in (0, 1] of each visible GPU's memory.
FRACTION_ENV = "PODIUM_GPU_MEMORY_CAP_FRACTION"
#: Environment variable: the cap in bytes per visible GPU.
BYTES_ENV = "PODIUM_GPU_MEMORY_CAP_BYTES"
#: Smallest byte cap accepted (below this the CUDA context alone cannot fit anything).
MIN_CAP_BYTES = 1 << 20
#: Largest byte cap accepted (1 PiB; no GPU comes near).
MAX_CAP_BYTES = 1 << 50


@dataclasses.dataclass
class CapReport:
    """What a worker was asked to cap and what it did."""

    #: A cap was asked for (one of the two variables was set).
    requested: bool = False
    #: The asked fraction (0: a byte cap was asked).
    fraction: float = 0.0
    #: The asked byte limit (0: a fraction was asked).
    bytes: int = 0
    #: torch's allocator limit was set on every visible device.
    applied: bool = False
    #: The effective limit on cuda:0 in bytes (0 where not applied and asked as a fraction).
    cap_bytes: int = 0
    #: The effective fraction of cuda:0's memory (fraction asked, or bytes / total).
    effective_fraction: float = 0.0
    #: One line: "applied: ..." or "not applied: no CUDA" and the like.
    detail: str = "no cap asked"

    def stats(self) -> dict[str, float]:
        """The numbers a worker's Describe stats carry (``gpu_memory_cap_*``)."""
        if not self.requested:
            return {}
        return {"gpu_memory_cap_requested": 1.0, "gpu_memory_cap_applied": float(self.applied),
                "gpu_memory_cap_fraction": float(self.fraction), "gpu_memory_cap_bytes": float(
                    self.cap_bytes or self.bytes), "gpu_memory_cap_effective_fraction": self.effective_fraction}

    def ready_fields(self) -> dict[str, Any]:
        """The report as the fields of ``podium.v1.GpuMemoryCap`` (the ready line carries it)."""
        return {"fraction": self.fraction, "bytes": self.bytes, "applied": self.applied,
                "cap_bytes": self.cap_bytes, "detail": self.detail}

    def describe(self) -> str:
        """The cap in words, e.g. "1/3 of the GPU (26.7 GiB of 80.0 GiB)"."""
        if self.fraction:
            text = f"{fraction_words(self.fraction)} of the GPU"
            if self.cap_bytes:
                text += f" ({gib_text(self.cap_bytes)} of {gib_text(round(self.cap_bytes / self.fraction))})"
            return text
        return f"{gib_text(self.bytes)} per GPU"


def gib_text(n: int) -> str:
    """Bytes as GiB with one decimal ("26.7 GiB")."""
    return f"{n / 1024**3:.1f} GiB"


def fraction_words(value: float) -> str:
    """A fraction as "1/3" when it is one with a small denominator, else 4 digits."""
    close = Fraction(value).limit_denominator(64)
    return str(close) if abs(float(close) - value) < 1e-9 else f"{value:.4g}"


def cap_env(cap: Any, max_colocate_count: int = 1) -> dict[str, str]:
    """The worker environment for a ``gpu_memory_cap`` argument (``{}`` for None).

    ``cap`` is ``None`` (off), ``"fraction"`` (follow the slot: ``1/max_colocate_count``),
    a float in (0, 1] (that fraction of the GPU), an int (bytes) or a size string
    ("20GiB", "512MB"). Raises InvalidArgumentError for anything else.
    """
    if cap is None:
        return {}
    if isinstance(cap, bool):
        raise InvalidArgumentError(f"gpu_memory_cap must be None, 'fraction', a fraction or a size, got {cap!r}")
    if isinstance(cap, str) and cap.strip().lower() == "fraction":
        if not isinstance(max_colocate_count, int) or max_colocate_count <= 0:
            raise InvalidArgumentError(f"max_colocate_count must be a positive int, got {max_colocate_count!r}")
        return {FRACTION_ENV: repr(1.0 / max_colocate_count)}
    if isinstance(cap, float):
        return {FRACTION_ENV: repr(_check_fraction(cap, "gpu_memory_cap"))}
    if isinstance(cap, (int, str)):
        return {BYTES_ENV: str(_check_bytes(_parse_size(cap), "gpu_memory_cap"))}
    raise InvalidArgumentError(
        f"gpu_memory_cap must be None, 'fraction', a float in (0, 1], a byte count or a size "
        f"like '20GiB', got {type(cap).__name__} {cap!r}")


def group_env(worker_env: Mapping[str, str] | None, pool: Any, cap: Any) -> dict[str, str] | None:
    """A WorkerGroup's ``worker_env`` plus the cap variables of its own ``cap``, else its
    pool's ``gpu_memory_cap`` (unchanged when neither asks for one)."""
    if cap is None and pool is not None:
        cap = getattr(pool, "gpu_memory_cap", None)
    if cap is None:
        return None if worker_env is None else dict(worker_env)
    if pool is not None and not pool.use_gpu:
        raise InvalidArgumentError("gpu_memory_cap needs a pool with use_gpu=True (a CPU pool has no GPU memory)")
    env = {k: v for k, v in (worker_env or {}).items() if k not in (FRACTION_ENV, BYTES_ENV)}
    env.update(cap_env(cap, pool.max_colocate_count if pool is not None else 1))
    return env


_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def _parse_size(text: int | str) -> int:
    # The same grammar as the node agent's --fake-gpu-memory (podium.worker.agent.gpus.parse_size).
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidArgumentError(
            f"bad gpu_memory_cap size {text!r}: use 'fraction', a fraction in (0, 1], or a number "
            f"with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return int(float(match.group(1)) * _UNITS[unit])


def _check_fraction(value: float, name: str) -> float:
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise InvalidArgumentError(f"{name} as a fraction must be in (0, 1], got {value!r}")
    return value


def _check_bytes(value: int, name: str) -> int:
    if not MIN_CAP_BYTES <= value <= MAX_CAP_BYTES:
        raise InvalidArgumentError(
            f"{name} in bytes must be between {MIN_CAP_BYTES} (1 MiB) and {MAX_CAP_BYTES} (1 PiB), got {value}")
    return value


def parse_env(env: Mapping[str, str]) -> CapReport:
    """The cap a worker environment asks for (not applied yet). Raises InvalidArgumentError
    for a malformed value or for both variables at once."""
    fraction_text, bytes_text = env.get(FRACTION_ENV, "").strip(), env.get(BYTES_ENV, "").strip()
    if fraction_text and bytes_text:
        raise InvalidArgumentError(f"set {FRACTION_ENV} or {BYTES_ENV}, not both")
    if fraction_text:
        try:
            value = float(fraction_text)
        except ValueError:
            raise InvalidArgumentError(f"{FRACTION_ENV} must be a number in (0, 1], got {fraction_text!r}") from None
        return CapReport(requested=True, fraction=_check_fraction(value, FRACTION_ENV), detail="not applied yet")
    if bytes_text:
        try:
            value = int(bytes_text)
        except ValueError:
            raise InvalidArgumentError(f"{BYTES_ENV} must be an integer byte count, got {bytes_text!r}") from None
        return CapReport(requested=True, bytes=_check_bytes(value, BYTES_ENV), detail="not applied yet")
    return CapReport()


def requested_cap(env: Mapping[str, str], total_bytes: int) -> dict | None:
    """What a worker environment asks for on a GPU of ``total_bytes`` (for /v1/placement):
    ``{"fraction", "bytes", "text"}``, or None when no cap (or a malformed one) is asked."""
    try:
        report = parse_env(env)
    except InvalidArgumentError:
        return None
    if not report.requested:
        return None
    if report.fraction:
        cap_bytes = int(report.fraction * total_bytes)
        return {"fraction": report.fraction, "bytes": cap_bytes, "text": fraction_words(report.fraction)}
    fraction = min(1.0, report.bytes / total_bytes) if total_bytes else 0.0
    return {"fraction": fraction, "bytes": min(report.bytes, total_bytes) if total_bytes else report.bytes,
            "text": gib_text(report.bytes)}
