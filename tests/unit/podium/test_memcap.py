"""The GPU memory cap's arithmetic and words (podium.memcap) and applying it in a process
without CUDA (podium.worker.host.gpucap): recorded as not applied, still reported."""

from __future__ import annotations

import pytest
import torch

from podium import memcap
from podium.errors import InvalidArgumentError
from podium.worker.host import gpucap


def test_cap_env_forms():
    assert memcap.cap_env(None) == {}
    assert memcap.cap_env("fraction", 4) == {memcap.FRACTION_ENV: "0.25"}
    assert memcap.cap_env(" Fraction ", 1) == {memcap.FRACTION_ENV: "1.0"}
    assert memcap.cap_env(0.5) == {memcap.FRACTION_ENV: "0.5"}
    assert memcap.cap_env(1 << 30) == {memcap.BYTES_ENV: str(1 << 30)}
    assert memcap.cap_env("20GiB") == {memcap.BYTES_ENV: str(20 << 30)}
    assert memcap.cap_env("1.5 GB") == {memcap.BYTES_ENV: "1500000000"}


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01, float("inf"), float("nan"), True, False, 0, 1023,
                                 1 << 51, "lots", "12 parsecs", "", [0.5], {"GPU": 1}])
def test_bad_caps_name_what_is_accepted(bad):
    with pytest.raises(InvalidArgumentError, match="gpu_memory_cap"):
        memcap.cap_env(bad, 2)


def test_fraction_needs_a_positive_colocate_count():
    with pytest.raises(InvalidArgumentError, match="max_colocate_count"):
        memcap.cap_env("fraction", 0)


def test_parse_env():
    assert not memcap.parse_env({}).requested
    report = memcap.parse_env({memcap.FRACTION_ENV: "0.25"})
    assert report.requested and report.fraction == 0.25 and not report.applied
    assert memcap.parse_env({memcap.BYTES_ENV: str(8 << 30)}).bytes == 8 << 30
    for env, match in [({memcap.FRACTION_ENV: "0.5", memcap.BYTES_ENV: "1048576"}, "not both"),
                       ({memcap.FRACTION_ENV: "half"}, "must be a number"),
                       ({memcap.FRACTION_ENV: "2"}, r"\(0, 1\]"),
                       ({memcap.BYTES_ENV: "1.5e9"}, "integer byte count"),
                       ({memcap.BYTES_ENV: "10"}, "between")]:
        with pytest.raises(InvalidArgumentError, match=match):
            memcap.parse_env(env)


def test_requested_cap_in_bytes_of_the_gpu():
    total = 80 << 30
    assert memcap.requested_cap({}, total) is None
    assert memcap.requested_cap({memcap.FRACTION_ENV: "garbage"}, total) is None
    assert memcap.requested_cap(memcap.cap_env("fraction", 2), total) == {
        "fraction": 0.5, "bytes": 40 << 30, "text": "1/2"}
    assert memcap.requested_cap(memcap.cap_env("20GiB"), total) == {
        "fraction": 0.25, "bytes": 20 << 30, "text": "20.0 GiB"}
    # A byte cap above the card is the card.
    assert memcap.requested_cap(memcap.cap_env("100GiB"), total)["bytes"] == total


class _Pool:
    def __init__(self, cap, use_gpu=True, max_colocate_count=3):
        self.gpu_memory_cap, self.use_gpu, self.max_colocate_count = cap, use_gpu, max_colocate_count


def test_group_env_takes_the_groups_cap_else_the_pools():
    assert memcap.group_env(None, _Pool(None), None) is None
    assert memcap.group_env({"A": "1"}, _Pool(None), None) == {"A": "1"}
    assert memcap.group_env({"A": "1"}, _Pool("fraction"), None) == {"A": "1", memcap.FRACTION_ENV: repr(1 / 3)}
    # The group's own cap wins and replaces a cap variable the user put in worker_env.
    assert memcap.group_env({memcap.FRACTION_ENV: "0.9"}, _Pool("fraction"), "1GiB") == {
        memcap.BYTES_ENV: str(1 << 30)}
    with pytest.raises(InvalidArgumentError, match="use_gpu=True"):
        memcap.group_env(None, _Pool(None, use_gpu=False), 0.5)


def test_without_cuda_the_cap_is_recorded_and_not_applied():
    assert not torch.cuda.is_available()
    report = gpucap.apply_from_env(memcap.cap_env("fraction", 3))
    assert report.requested and not report.applied and report.detail == "not applied: no CUDA"
    assert gpucap.current() is report
    assert report.stats() == {"gpu_memory_cap_requested": 1.0, "gpu_memory_cap_applied": 0.0,
                              "gpu_memory_cap_fraction": pytest.approx(1 / 3), "gpu_memory_cap_bytes": 0.0,
                              "gpu_memory_cap_effective_fraction": pytest.approx(1 / 3)}
    message = gpucap.oom_message(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB"))
    assert message.startswith("CUDA out of memory under the Podium GPU memory cap of 1/3 of the GPU")
    assert "not applied: no CUDA" in message and message.endswith("Tried to allocate 1 GiB")
    assert gpucap.oom_message(RuntimeError("CUDA out of memory")) is None  # only torch's OOM type
    assert gpucap.apply_from_env({}).stats() == {}
    assert gpucap.oom_message(torch.OutOfMemoryError("x")) is None  # no cap: torch's words only


def test_vllm_budget_follows_the_cap():
    gpucap.apply_from_env(memcap.cap_env("fraction", 2))
    assert gpucap.vllm_memory_utilization(0.9) == 0.5 and gpucap.vllm_memory_utilization(0.3) == 0.3
    with pytest.raises(InvalidArgumentError):
        gpucap.vllm_memory_utilization(1.2)
    gpucap.apply_from_env({})
    assert gpucap.vllm_memory_utilization(0.9) == 0.9
