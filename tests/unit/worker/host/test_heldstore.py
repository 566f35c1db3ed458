"""The held-result store: ids, budget accounting, release, configuration."""

from __future__ import annotations

import pytest

from podium import errors
from podium.worker.host.heldstore import HeldStore, default_budget


def test_put_get_release_account_bytes():
    store = HeldStore(budget_bytes=100)
    a = store.put("a", None, 40, -1)
    b = store.put("b", None, 60, 3)
    assert a.object_id != b.object_id and a.object_id.startswith("o-")
    assert store.used_bytes == 100 and len(store) == 2
    assert store.get(b.object_id).rows == 3
    assert store.release([a.object_id, a.object_id, "o-nope"]) == 1
    assert store.used_bytes == 60
    with pytest.raises(errors.NotFoundError, match=a.object_id):
        store.get(a.object_id)
    store.clear()
    assert store.used_bytes == 0 and len(store) == 0


def test_budget_exceeded_names_budget_size_and_what_is_held():
    store = HeldStore(budget_bytes=100)
    store.put("a", None, 70, -1)
    with pytest.raises(errors.ResourceExhaustedError) as caught:
        store.put("b", None, 31, -1)
    text = str(caught.value)
    assert "100 bytes" in text and "31 bytes" in text and "1 results of 70 bytes" in text
    assert caught.value.details == {"budget_bytes": "100", "size_bytes": "31", "held_bytes": "70",
                                    "held_count": "1"}
    with pytest.raises(errors.ResourceExhaustedError):
        store.check_room(31)
    store.check_room(30)
    assert store.used_bytes == 70  # a refused put changes nothing


@pytest.mark.parametrize("env, expected", [
    ({"PODIUM_HOLD_BUDGET_BYTES": "12345"}, 12345),
    ({"PODIUM_HOLD_BUDGET_BYTES": "0"}, 0),
    ({"PODIUM_HOLD_BUDGET_BYTES": "abc"}, errors.InvalidArgumentError),
    ({"PODIUM_HOLD_BUDGET_BYTES": "-1"}, errors.InvalidArgumentError),
])
def test_budget_from_environment(env, expected):
    if isinstance(expected, type):
        with pytest.raises(expected, match="PODIUM_HOLD_BUDGET_BYTES"):
            default_budget(env)
    else:
        assert default_budget(env) == expected


def test_default_budget_is_a_quarter_of_ram():
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_budget({}) == ram // 4


def test_a_dead_borrowers_borrows_are_given_back_for_it():
    store = HeldStore(budget_bytes=1000)
    shared = store.put("v", None, 10, -1)
    alone = store.put("w", None, 10, -1)
    store.borrow([shared.object_id, alone.object_id], "10.0.0.1:1")
    store.borrow([shared.object_id], "10.0.0.2:1")
    assert store.borrow_count(shared.object_id) == 2 and sorted(store.borrowers()) == ["10.0.0.1:1", "10.0.0.2:1"]
    assert store.release([shared.object_id, alone.object_id]) == 2
    assert store.kept_for_borrowers(shared.object_id) and store.kept_for_borrowers(alone.object_id)
    assert store.borrower_gone("10.0.0.1:1") == 1  # its lone borrow went: that value too
    assert alone.object_id not in store and shared.object_id in store
    assert store.borrowers() == ["10.0.0.2:1"]
    assert store.unborrow([shared.object_id], "10.0.0.1:1") == 0  # a late return of the dead one's: ignored
    assert shared.object_id in store
    assert store.unborrow([shared.object_id], "10.0.0.2:1") == 1
    assert len(store) == 0 and store.used_bytes == 0 and store.borrowers() == []


def test_one_value_has_a_bounded_number_of_borrowers(monkeypatch):
    from podium.errors import ResourceExhaustedError
    from podium.worker.host import heldstore

    monkeypatch.setattr(heldstore, "MAX_BORROWERS", 2)
    store = HeldStore(budget_bytes=1000)
    held = store.put("v", None, 10, -1)
    store.borrow([held.object_id], "a")
    store.borrow([held.object_id], "b")
    store.borrow([held.object_id], "b")  # a borrower already counted adds no entry
    with pytest.raises(ResourceExhaustedError, match="borrowers"):
        store.borrow([held.object_id], "c")
