"""Fixtures the rollout server tests share (a module that defines its own keeps it)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama (8 words, seed 1) built offline, one per test module."""
    from podium.rollout.recipes.tinymodel import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny"), words=[f"w{i}" for i in range(8)], seed=1)


@pytest.fixture(scope="module")
def cluster():
    """An embedded 8-CPU cluster for the module's replicas."""
    import podium

    podium.init(num_cpus=8)
    yield
    podium.shutdown()
