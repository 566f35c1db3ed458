"""Unit tests open no network sockets (docs/architecture.md, section 8): a test that binds
or connects one belongs in tests/integration. Socket pairs (asyncio's self-pipe) are not
network sockets and stay allowed."""

from __future__ import annotations

import socket

import pytest

NETWORK = (socket.AF_INET, socket.AF_INET6)


def _refuse(name: str, original):
    def guarded(self, *args, **kwargs):
        if self.family in NETWORK and self.type == socket.SOCK_STREAM:
            raise AssertionError(f"a unit test called socket.{name}{args!r}: unit tests open no network "
                                 "sockets; move this test to tests/integration")
        return original(self, *args, **kwargs)
    return guarded


@pytest.fixture(autouse=True)
def _no_network_sockets(monkeypatch):
    for name in ("bind", "connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, _refuse(name, getattr(socket.socket, name)))
