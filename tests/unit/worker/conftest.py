"""Fixtures for the worker-side unit tests."""

from __future__ import annotations

import pytest

#: Variables a Worker reads or writes back into the environment.
TOUCHED_ENV = ["WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "LOCAL_RANK",
               "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
               "REDIS_STORE_SERVER_HOST", "WG_BACKEND", "PODIUM_NODE_ADDRESS", "MY_HOST_IP",
               "MY_HOST_IPV6"]


@pytest.fixture
def env(monkeypatch):
    """A clean worker environment, rank 1 of 4 (``env.setenv`` changes it); every variable a
    Worker writes is restored afterwards."""
    for key in TOUCHED_ENV:
        # setenv first so that monkeypatch remembers the key and removes what
        # Worker.__init__ writes back, even when it was absent before.
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    return monkeypatch
