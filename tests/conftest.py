"""Shared fixtures for every test layer (kept small and generic)."""

from __future__ import annotations

import asyncio
import secrets

import pytest


@pytest.fixture
def token() -> str:
    """A fresh cluster token for the servers a test starts."""
    return secrets.token_urlsafe(16)


@pytest.fixture
def arun():
    """Run a coroutine to completion on a fresh event loop, with a deadline (seconds).

    ``arun(scenario(), timeout=60)``; tests have no asyncio plugin, so async
    scenarios go through this. A hang fails as TimeoutError instead of blocking.
    """
    def run(coro, timeout: float = 60.0):
        async def bounded():
            return await asyncio.wait_for(coro, timeout)
        return asyncio.run(bounded())
    return run
