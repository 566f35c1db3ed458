"""Fixtures for integration tests: real servers in the test process."""

from __future__ import annotations

import secrets

import pytest

from tests.support.live_services import LiveServices


@pytest.fixture(scope="module")
def live(request, tmp_path_factory):
    """A live scheduler, node agent and worker host in this process (one set per module).

    A module sets ``LIVE_WORKER_ENV = {...}`` to give the worker host extra environment.
    """
    worker_env = getattr(request.module, "LIVE_WORKER_ENV", None)
    with LiveServices(secrets.token_urlsafe(16), tmp_path_factory.mktemp("live"),
                      **({"worker_env": worker_env} if worker_env else {})) as services:
        yield services
