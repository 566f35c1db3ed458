"""Worker slots inside one bundle: who holds how much of its CPU and GPU.

A verl pool bundle is ``{"CPU": max_colocate_count, "GPU": 1}`` and each worker asks
for ``1/max_colocate_count`` GPU and 1 CPU, so the bundle's CPU count is its number
of colocation slots. Amounts are integer units (podium.resources), so three workers
of 1/3 fill the GPU exactly and a fourth is refused, however many come and go.
"""

from __future__ import annotations

from collections.abc import Mapping

from podium.errors import AlreadyExistsError, InvalidSpecError, NotFoundError, SlotFullError
from podium.resources import CPU_UNITS, GPU_UNITS, BundleSpec, format_cpus, format_gpus

__all__ = ["BundleLedger"]


def _check_units(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidSpecError(f"{name} must be an int >= 0 (units), got {value!r}")


class BundleLedger:
    """The slots reserved in one bundle (mutable, pure: no I/O, no clock).

    ``label`` starts every refusal message, e.g. ``"bundle 0 of pg-1"``.
    """

    def __init__(self, cpu_units: int, gpu_units: int, *, label: str = "bundle") -> None:
        _check_units("cpu_units", cpu_units)
        _check_units("gpu_units", gpu_units)
        self.cpu_units = cpu_units
        self.gpu_units = gpu_units
        self.label = label
        self._slots: dict[str, tuple[int, int]] = {}
        self._held_cpu = 0
        self._held_gpu = 0

    @classmethod
    def for_bundle(cls, bundle: BundleSpec, *, label: str = "bundle") -> "BundleLedger":
        """A ledger with the capacity of ``bundle``."""
        return cls(bundle.cpu_units, bundle.gpu_units, label=label)

    @property
    def free_cpu_units(self) -> int:
        """CPU units no slot holds."""
        return self.cpu_units - self._held_cpu

    @property
    def free_gpu_units(self) -> int:
        """GPU units no slot holds."""
        return self.gpu_units - self._held_gpu

    @property
    def slots(self) -> Mapping[str, tuple[int, int]]:
        """slot id -> (cpu units, gpu units), a copy."""
        return dict(self._slots)

    def _refuse(self, what: str, asked: int, free: int, capacity: int, per: int) -> SlotFullError:
        n = len(self._slots)
        holders = f"{n} worker{'s' if n != 1 else ''} hold{'s' if n == 1 else ''} it"
        cap = format_gpus(capacity) if per == GPU_UNITS else format_cpus(capacity)
        return SlotFullError(
            f"{self.label}: asks {asked / per:.3f} {what}, {free / per:.3f} free of {cap} "
            f"{what} ({holders})")

    def reserve(self, slot_id: str, cpu_units: int, gpu_units: int) -> None:
        """Hold ``cpu_units``/``gpu_units`` of the bundle for ``slot_id``, or raise.

        SlotFullError names what was asked and what is free; a slot id already
        held raises AlreadyExistsError. Nothing changes when it raises.
        """
        _check_units("cpu_units", cpu_units)
        _check_units("gpu_units", gpu_units)
        if slot_id in self._slots:
            raise AlreadyExistsError(f"{self.label}: slot {slot_id!r} is already reserved")
        if gpu_units > self.free_gpu_units:
            raise self._refuse("GPU", gpu_units, self.free_gpu_units, self.gpu_units, GPU_UNITS)
        if cpu_units > self.free_cpu_units:
            raise self._refuse("CPU", cpu_units, self.free_cpu_units, self.cpu_units, CPU_UNITS)
        self._slots[slot_id] = (cpu_units, gpu_units)
        self._held_cpu += cpu_units
        self._held_gpu += gpu_units

    def release(self, slot_id: str) -> tuple[int, int]:
        """Give back what ``slot_id`` held; returns it. Unknown id: NotFoundError."""
        try:
            cpu, gpu = self._slots.pop(slot_id)
        except KeyError:
            raise NotFoundError(f"{self.label}: no slot {slot_id!r}") from None
        self._held_cpu -= cpu
        self._held_gpu -= gpu
        return cpu, gpu
