"""The scheduling core stays pure: importing it pulls in no gRPC and no asyncio."""

from __future__ import annotations

import subprocess
import sys

CHECK = ("import podium.scheduler.core, podium.resources, sys; "
         "bad = sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.') "
         "or m == 'asyncio'); assert not bad, bad")


def test_core_imports_no_grpc_or_asyncio():
    # A fresh interpreter: this test process may already have loaded grpc elsewhere.
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
