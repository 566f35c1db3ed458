"""podium.resources: exact units, strategies, bundle validation, worker env, node order."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from podium.errors import InvalidSpecError
from podium.resources import (CPU_UNITS, GPU_UNITS, SYSTEM_ENV_KEYS, BundleSpec, Strategy,
                              check_user_env, cpu_units, format_cpus, format_gpus, gpu_units,
                              sort_key_address, system_env, validate_bundles)
from podium.v1 import common_pb2


def test_gpu_units_is_the_lcm_of_1_to_16():
    assert GPU_UNITS == math.lcm(*range(1, 17))


@pytest.mark.parametrize("amount, units", [
    (1, GPU_UNITS),
    (1.0, GPU_UNITS),
    (2, 2 * GPU_UNITS),
    (8.0, 8 * GPU_UNITS),
    (1 / 3, 240240),             # the float 0.333... snaps to exactly 1/3
    (0.5, 360360),
    (0.1, 72072),                # 0.1 is not exact in binary; 1/10 is in units
    (1 / 16, 45045),
    (Fraction(2, 3), 480480),
    (1 / 17, 720720 // 17),      # not a divisor of 720720: rounded down so 17 still fit
])
def test_gpu_units_exact(amount, units):
    assert gpu_units(amount) == units


@pytest.mark.parametrize("k", range(1, 17))
def test_k_workers_of_one_kth_fill_a_gpu_exactly(k):
    assert gpu_units(1 / k) * k == GPU_UNITS


@pytest.mark.parametrize("bad", [0, 0.0, -1, -0.5, 1.5, 2.5, float("nan"), float("inf"),
                                 float("-inf"), "1", None, True])
def test_gpu_units_rejects_and_names_the_value(bad):
    with pytest.raises(InvalidSpecError) as info:
        gpu_units(bad)
    assert repr(bad) in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("amount, units", [(0, 0), (1, 1000), (3, 3000), (0.5, 500),
                                           (1 / 3, 333), (64, 64 * CPU_UNITS)])
def test_cpu_units(amount, units):
    assert cpu_units(amount) == units


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "2", None])
def test_cpu_units_rejects_and_names_the_value(bad):
    with pytest.raises(InvalidSpecError, match="CPU") as info:
        cpu_units(bad)
    assert repr(bad) in str(info.value)


def test_formatting_names_numbers():
    assert format_gpus(8 * GPU_UNITS) == "8"
    assert format_gpus(240240) == "0.333"
    assert format_cpus(16000) == "16"
    assert format_cpus(500) == "0.500"


@pytest.mark.parametrize("value, expected", [
    ("PACK", Strategy.PACK), ("spread", Strategy.SPREAD), ("Strict_Pack", Strategy.STRICT_PACK),
    (4, Strategy.STRICT_SPREAD), (Strategy.PACK, Strategy.PACK),
])
def test_strategy_parse(value, expected):
    assert Strategy.parse(value) is expected


@pytest.mark.parametrize("bad", ["BEST", 0, 5, "", None, True, 1.0])
def test_strategy_parse_rejects(bad):
    with pytest.raises(InvalidSpecError, match="unknown placement strategy"):
        Strategy.parse(bad)


def test_strategy_matches_the_wire_enum():
    for member in Strategy:
        assert common_pb2.Strategy.Value(member.name) == int(member)


@pytest.mark.parametrize("resources, cpu, gpu, needed", [
    ({"CPU": 3, "GPU": 1}, 3000, GPU_UNITS, 1),
    ({"GPU": 1}, 0, GPU_UNITS, 1),
    ({"CPU": 4}, 4000, 0, 0),                         # CPU-only
    ({"CPU": 4, "GPU": 0}, 4000, 0, 0),               # GPU 0 spells "no GPU"
    ({"CPU": 1, "GPU": 0.5}, 1000, GPU_UNITS // 2, 1),  # a fraction owns one GPU
    ({"CPU": 1, "GPU": 4}, 1000, 4 * GPU_UNITS, 4),
])
def test_bundle_from_resources(resources, cpu, gpu, needed):
    b = BundleSpec.from_resources(resources)
    assert (b.cpu_units, b.gpu_units, b.gpus_needed) == (cpu, gpu, needed)


def test_bundle_round_trips_through_resources():
    for resources in ({"CPU": 3, "GPU": 1}, {"CPU": 1, "GPU": 1 / 3}, {"CPU": 0.5, "GPU": 8}):
        b = BundleSpec.from_resources(resources)
        assert BundleSpec.from_resources(b.to_resources()) == b
    assert BundleSpec.from_resources({"CPU": 3, "GPU": 1}).to_resources() == {"CPU": 3.0, "GPU": 1.0}


@pytest.mark.parametrize("resources, named", [
    ({"CPU": 1, "bad name": 4}, "'bad name'"),        # a custom resource name with a space
    ({"cpu": 1}, "'cpu'"),                            # CPU in another case: a typo, not a resource
    ({"CPU": -1}, "-1"),
    ({"CPU": float("nan")}, "nan"),
    ({"GPU": float("nan")}, "nan"),
    ({"GPU": 1.5}, "1.5"),
    ({"GPU": -1}, "-1"),
    ({}, "empty bundle"),
    ({"CPU": 0}, "empty bundle"),
    ({"CPU": 0, "GPU": 0}, "empty bundle"),
    ([("CPU", 1)], "mapping"),
])
def test_bundle_rejects_and_names_key_or_value(resources, named):
    with pytest.raises(InvalidSpecError) as info:
        BundleSpec.from_resources(resources)
    assert named in str(info.value)


def test_validate_bundles():
    assert validate_bundles([{"CPU": 1, "GPU": 1}] * 2) == (BundleSpec(1000, GPU_UNITS),) * 2
    with pytest.raises(InvalidSpecError, match="at least one bundle"):
        validate_bundles([])
    with pytest.raises(InvalidSpecError, match="bundle 1: .*'T PU'"):
        validate_bundles([{"GPU": 1}, {"T PU": 1}])
    with pytest.raises(InvalidSpecError, match="list"):
        validate_bundles({"GPU": 1})


def test_bundle_spec_checks_its_units():
    with pytest.raises(InvalidSpecError, match="whole number"):
        BundleSpec(cpu_units=0, gpu_units=GPU_UNITS + 1)
    with pytest.raises(InvalidSpecError, match="cpu_units"):
        BundleSpec(cpu_units=-1, gpu_units=1)


def test_check_user_env_names_every_protected_key():
    check_user_env({"FOO": "bar"})
    check_user_env(None)
    with pytest.raises(ValueError) as info:
        check_user_env({"RANK": "3", "FOO": "x", "CUDA_VISIBLE_DEVICES": "0"})
    text = str(info.value)
    assert text.startswith("Cannot override protected system env")
    assert "'RANK'" in text and "'CUDA_VISIBLE_DEVICES'" in text and "FOO" not in text
    for key in SYSTEM_ENV_KEYS:
        with pytest.raises(InvalidSpecError, match=key):
            check_user_env({key: "1"})


@pytest.mark.parametrize("env, named", [({1: "x"}, "1"), ({"FOO": 2}, "'FOO'"),
                                        ({"FOO": None}, "'FOO'")])
def test_check_user_env_rejects_non_str(env, named):
    with pytest.raises(InvalidSpecError, match="must be str") as info:
        check_user_env(env)
    assert named in str(info.value)


def test_system_env():
    env = system_env(rank=1, world_size=4, master_addr="10.0.0.9", master_port=29500,
                     gpu_indices=[2, 3], group="actor_", local_world_size=2,
                     worker_id="w-7", node_address="10.0.0.10")
    assert env == {
        "RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29500",
        "CUDA_VISIBLE_DEVICES": "2,3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "PODIUM_LOCAL_WORLD_SIZE": "2", "RAY_LOCAL_WORLD_SIZE": "2", "WG_PREFIX": "actor_",
        "WG_BACKEND": "podium", "PODIUM_WORKER_ID": "w-7", "PODIUM_NODE_ADDRESS": "10.0.0.10",
    }
    assert set(env) <= SYSTEM_ENV_KEYS
    cpu_only = system_env(rank=0, world_size=1, master_addr="127.0.0.1", master_port=1,
                          gpu_indices=(), group="g", local_world_size=1, worker_id="w",
                          node_address="127.0.0.1")
    assert cpu_only["CUDA_VISIBLE_DEVICES"] == ""


def test_sort_key_address_orders_ipv4_numerically_then_ipv6_then_names():
    addresses = ["node-b", "10.0.0.10", "::1", "10.0.0.9", "127.0.0.2", "[fe80::1]:50051",
                 "10.0.0.9:7000", "node-a", "2.0.0.1"]
    assert sorted(addresses, key=sort_key_address) == [
        "2.0.0.1", "10.0.0.9", "10.0.0.9:7000", "10.0.0.10", "127.0.0.2",
        "::1", "[fe80::1]:50051", "node-a", "node-b"]
