"""Shared fixtures for every test layer (kept small and generic): ``token``, ``arun``,
``eventually`` (a polling wait with a deadline) and ``tls`` (a throwaway CA and certificate)."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from tests.support.shmfiles import mark_test_start


@pytest.fixture(autouse=True)
def _shm_files_of_this_test():
    """Leak checks count the segment files this test made (tests.support.shmfiles)."""
    mark_test_start()


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


@pytest.fixture
def eventually():
    """``eventually(predicate, what, timeout=30)``: poll until ``predicate()`` is truthy and
    return its value; fail naming ``what`` when the deadline passes."""
    from tests.support.waiting import eventually as wait

    return wait


@pytest.fixture(scope="session")
def tls(tmp_path_factory):
    """Mutual-TLS material for loopback services: one throwaway CA and a certificate for
    127.0.0.1-127.0.0.9 and localhost (server and client use), shared by the session."""
    from tests.support.certs import make_tls

    return make_tls(tmp_path_factory.mktemp("tls"))

