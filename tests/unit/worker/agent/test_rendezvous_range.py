"""The rendezvous port range (podium.worker.agent.ports): outside the kernel's ephemeral
range, configurable, a bad setting refused with the reason (no sockets here)."""

from __future__ import annotations

import pytest

from podium import errors
from podium.worker.agent.ports import DEFAULT_RANGE, RANGE_ENV, ephemeral_range, rendezvous_range


def test_default_range_lies_below_the_ephemeral_range():
    assert rendezvous_range({}, (32768, 60999)) == (DEFAULT_RANGE[0], 32767)
    assert rendezvous_range({}, (25000, 60999)) == (DEFAULT_RANGE[0], 24999)


def test_default_range_moves_above_when_the_ephemeral_range_starts_low():
    assert rendezvous_range({}, (10000, 60999)) == (61000, 65535)
    with pytest.raises(errors.UnavailableError, match=RANGE_ENV):
        rendezvous_range({}, (1024, 65535))


def test_a_configured_range_is_used_and_checked():
    assert rendezvous_range({RANGE_ENV: "21000-21099"}, (32768, 60999)) == (21000, 21099)
    for bad, why in [("21000", "LOW-HIGH"), ("x-y", "LOW-HIGH"), ("900-1000", "1024"),
                     ("30000-33000", "overlaps the kernel's ephemeral range")]:
        with pytest.raises(errors.InvalidArgumentError, match=why):
            rendezvous_range({RANGE_ENV: bad}, (32768, 60999))


def test_the_ephemeral_range_is_read_from_proc(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert ephemeral_range(str(path)) == (40000, 50000)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
