"""Applying the GPU memory cap in a worker process, and naming it in out-of-memory errors.

The cap is asked for with ``gpu_memory_cap=`` on a ResourcePool or WorkerGroup and travels
in the worker's environment (:mod:`podium.memcap`). :func:`apply_from_env` runs in
``start_host`` before the host decodes any payload or imports the user's class, and sets
``torch.cuda.set_per_process_memory_fraction`` on every device the worker sees. Without
CUDA (or torch) nothing is applied; the report says so ("not applied: no CUDA") and still
carries the cap, which the worker's Describe stats show (``gpu_memory_cap_*``).

What is covered: PyTorch's caching allocator, i.e. every tensor PyTorch allocates in this
process. What is not: memory allocated outside it (the CUDA context itself, NCCL buffers,
libraries calling ``cudaMalloc`` directly, a vLLM engine core running in its own process).
A vLLM engine takes its budget from ``gpu_memory_utilization``: pass the configured value
through :func:`vllm_memory_utilization`, which lowers it to the cap.

An allocation above the cap raises ``torch.OutOfMemoryError``; the host's error path
(:func:`oom_message`) puts the cap at the front of the message the caller sees.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

from podium.memcap import CapReport, fraction_words, gib_text, parse_env

__all__ = ["apply_from_env", "current", "oom_message", "vllm_memory_utilization"]

log = logging.getLogger("podium.worker.host")

_current = CapReport()


def apply_from_env(env: Mapping[str, str]) -> CapReport:
    """Read the cap from ``env`` and apply it to PyTorch's allocator on every visible device.

    Runs before user code in a worker (``start_host``). Without a cap asked it imports
    nothing. Records the outcome for :func:`current` and :func:`oom_message`.
    """
    global _current
    report = parse_env(env)
    if not report.requested:
        _current = report
        return report
    try:
        import torch
    except ImportError:
        report.detail = "not applied: torch is not installed"
        _current = report
        log.warning("GPU memory cap %s %s", report.describe(), report.detail)
        return report
    if not torch.cuda.is_available():
        report.detail = "not applied: no CUDA"
        report.effective_fraction = report.fraction
        _current = report
        log.info("GPU memory cap %s %s", report.describe(), report.detail)
        return report
    limits = []
    for index in range(torch.cuda.device_count()):
        total = int(torch.cuda.get_device_properties(index).total_memory)
        fraction = report.fraction or min(1.0, report.bytes / total)
        torch.cuda.set_per_process_memory_fraction(fraction, device=index)
        limits.append((index, fraction, int(fraction * total)))
    _, report.effective_fraction, report.cap_bytes = limits[0]
    report.applied = True
    report.detail = "applied: " + ", ".join(f"cuda:{i} {gib_text(b)} ({fraction_words(f)})" for i, f, b in limits)
    _current = report
    log.info("GPU memory cap %s", report.detail)
    return report


def current() -> CapReport:
    """The cap of this process as the host applied it (a fresh CapReport when none)."""
    return _current


def oom_message(exc: BaseException) -> str | None:
    """The message a CUDA out-of-memory error gets under a cap: the cap, then torch's text.

    None when ``exc`` is not torch's OutOfMemoryError or no cap was asked."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is None or not isinstance(exc, oom) or not _current.requested:
        return None
    state = "enforced" if _current.applied else _current.detail
    return (f"CUDA out of memory under the Podium GPU memory cap of {_current.describe()} ({state}; "
            f"set with gpu_memory_cap= on the ResourcePool or WorkerGroup): {exc}")


def vllm_memory_utilization(configured: float) -> float:
    """The ``gpu_memory_utilization`` to give a vLLM engine in this worker: the configured
    value, lowered to the cap's share of the GPU when a cap is asked (vLLM sizes its KV cache
    from this fraction; torch's allocator limit alone would only make it fail later)."""
    if not 0.0 < configured <= 1.0:
        from podium.errors import InvalidArgumentError
        raise InvalidArgumentError(f"gpu_memory_utilization must be in (0, 1], got {configured!r}")
    if not _current.requested or not _current.effective_fraction:
        return configured
    return min(configured, _current.effective_fraction)
