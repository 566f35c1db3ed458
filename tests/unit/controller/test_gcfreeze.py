"""init() freezes the import-time heap out of the collector's scans; shutdown() gives it back."""

from __future__ import annotations

import gc

import pytest

from podium.controller.session import gcfreeze


@pytest.fixture
def unfrozen():
    # A frozen heap here means an earlier test left a runtime initialised (init() without
    # shutdown()): that is a failure to report, not a reason to skip these tests.
    assert gc.get_freeze_count() == 0, "the heap is frozen: an earlier test did not call shutdown()"
    yield
    gc.unfreeze()


def test_freeze_moves_the_heap_out_of_the_collector_and_unfreeze_back(unfrozen, monkeypatch):
    monkeypatch.delenv("PODIUM_GC_FREEZE", raising=False)
    assert gcfreeze.freeze() is True
    assert gc.get_freeze_count() > 1000
    assert gcfreeze.freeze() is False  # already frozen: left alone
    gcfreeze.unfreeze()
    assert gc.get_freeze_count() == 0


def test_freeze_can_be_turned_off(unfrozen, monkeypatch):
    monkeypatch.setenv("PODIUM_GC_FREEZE", "0")
    assert gcfreeze.freeze() is False and gc.get_freeze_count() == 0


def test_a_disabled_collector_is_left_alone(unfrozen, monkeypatch):
    monkeypatch.delenv("PODIUM_GC_FREEZE", raising=False)
    gc.disable()
    try:
        assert gcfreeze.freeze() is False and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_frozen_objects_are_still_freed_by_reference_counting(unfrozen):
    import weakref

    class Thing:
        pass

    thing = Thing()
    alive = weakref.ref(thing)
    assert gcfreeze.freeze()
    del thing
    assert alive() is None
