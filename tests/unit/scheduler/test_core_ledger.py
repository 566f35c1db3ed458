"""BundleLedger: worker slots inside one bundle, in exact units (no float drift)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podium.errors import AlreadyExistsError, InvalidSpecError, NotFoundError, SlotFullError
from podium.resources import CPU_UNITS, GPU_UNITS, BundleSpec, gpu_units
from podium.scheduler.core import BundleLedger


def test_three_thirds_fill_a_gpu_and_a_fourth_is_refused():
    # verl's max_colocate_count=3: bundle {CPU: 3, GPU: 1}, workers of 1/3 GPU + 1 CPU.
    ledger = BundleLedger.for_bundle(BundleSpec.from_resources({"CPU": 3, "GPU": 1}),
                                     label="bundle 0 of pg X")
    third = gpu_units(1 / 3)
    for i in range(3):
        ledger.reserve(f"w{i}", CPU_UNITS, third)
    assert ledger.free_gpu_units == 0 and ledger.free_cpu_units == 0
    with pytest.raises(SlotFullError) as info:
        ledger.reserve("w3", CPU_UNITS, third)
    assert str(info.value) == ("bundle 0 of pg X: asks 0.333 GPU, 0.000 free of 1 GPU "
                               "(3 workers hold it)")
    assert set(ledger.slots) == {"w0", "w1", "w2"}  # the refusal changed nothing
    assert ledger.release("w1") == (CPU_UNITS, third)
    ledger.reserve("w3", CPU_UNITS, third)


def test_cpu_refusal_names_the_amounts():
    ledger = BundleLedger(2 * CPU_UNITS, GPU_UNITS, label="bundle 1 of pg-7")
    ledger.reserve("a", 2 * CPU_UNITS, 0)
    with pytest.raises(SlotFullError, match=r"bundle 1 of pg-7: asks 1.000 CPU, 0.000 free of 2 "
                                            r"CPU \(1 worker holds it\)"):
        ledger.reserve("b", CPU_UNITS, GPU_UNITS // 2)


def test_unknown_and_duplicate_slots():
    ledger = BundleLedger(CPU_UNITS, GPU_UNITS)
    with pytest.raises(NotFoundError, match="'nope'"):
        ledger.release("nope")
    ledger.reserve("a", 0, GPU_UNITS // 2)
    with pytest.raises(AlreadyExistsError, match="'a'"):
        ledger.reserve("a", 0, 1)
    assert ledger.free_gpu_units == GPU_UNITS // 2


@pytest.mark.parametrize("cpu, gpu", [(-1, 0), (0, -1), (0.5, 0), (0, 1.0), (True, 0)])
def test_amounts_must_be_unit_ints(cpu, gpu):
    with pytest.raises(InvalidSpecError):
        BundleLedger(CPU_UNITS, GPU_UNITS).reserve("a", cpu, gpu)


@pytest.mark.parametrize("k", range(1, 17))
def test_k_slots_of_one_kth_fit_exactly(k):
    ledger = BundleLedger(k * CPU_UNITS, GPU_UNITS)
    for i in range(k):
        ledger.reserve(str(i), CPU_UNITS, gpu_units(1 / k))
    with pytest.raises(SlotFullError):
        ledger.reserve("extra", 0, gpu_units(1 / 16))  # 720720 divisible by k: none left


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 16), st.integers(0, 2**31)),
                min_size=100, max_size=3000))
def test_random_reserve_release_cycles_never_drift(ops):
    ledger = BundleLedger(16 * CPU_UNITS, GPU_UNITS)
    held: dict[str, tuple[int, int]] = {}
    serial = 0
    for add, k, pick in ops:
        if add or not held:
            serial += 1
            slot, cpu, gpu = f"s{serial}", CPU_UNITS // k, gpu_units(1 / k)
            try:
                ledger.reserve(slot, cpu, gpu)
                held[slot] = (cpu, gpu)
            except SlotFullError:
                assert gpu > ledger.free_gpu_units or cpu > ledger.free_cpu_units
        else:
            slot = sorted(held)[pick % len(held)]
            assert ledger.release(slot) == held.pop(slot)
        assert ledger.free_gpu_units == GPU_UNITS - sum(g for _, g in held.values())
        assert ledger.free_cpu_units == 16 * CPU_UNITS - sum(c for c, _ in held.values())
        assert ledger.free_gpu_units >= 0 and ledger.free_cpu_units >= 0
    for slot in list(held):
        ledger.release(slot)
    assert ledger.free_gpu_units == GPU_UNITS and ledger.free_cpu_units == 16 * CPU_UNITS
    assert ledger.slots == {}
