"""podium.cli.healthprobe (the containers' health checks) against real servers on port 0."""

from __future__ import annotations

import asyncio
import http.server
import os
import subprocess
import sys
import threading

import pytest

from podium import rpc
from podium.cli.healthprobe import probe_grpc, probe_http


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_response(200 if self.path == "/healthz" else 503)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def http_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def _probe_cli(*args: str, token: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODIUM_")}
    env["PODIUM_TOKEN_FILE"] = os.devnull  # never the developer's ~/.podium/token
    if token:
        env["PODIUM_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "podium.cli.healthprobe", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_http_probe_is_healthy_only_on_200(http_url):
    assert probe_http(f"{http_url}/healthz") is None
    assert probe_http(f"{http_url}/other") == "HTTP 503"
    assert _probe_cli(f"{http_url}/healthz").returncode == 0
    failed = _probe_cli(f"{http_url}/other")
    assert failed.returncode == 1 and "HTTP 503" in failed.stderr


def test_http_probe_of_a_closed_port_fails_with_the_reason():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        problem = probe_http(f"http://127.0.0.1:{port}/healthz", timeout=5)
    assert problem is not None and "refused" in problem.lower()


def test_grpc_probe_presents_the_token(arun, token, monkeypatch):
    async def scenario():
        server, health = rpc.make_server(token)
        port = rpc.bind(server, "127.0.0.1", 0)
        await rpc.start_server(server, health)
        loop = asyncio.get_running_loop()
        try:
            monkeypatch.setenv("PODIUM_TOKEN", token)
            ok = await loop.run_in_executor(None, probe_grpc, f"127.0.0.1:{port}")
            monkeypatch.setenv("PODIUM_TOKEN", "wrong-" + token)
            denied = await loop.run_in_executor(None, probe_grpc, f"127.0.0.1:{port}")
            cli_ok, cli_denied = await asyncio.gather(
                loop.run_in_executor(None, lambda: _probe_cli("grpc", f"127.0.0.1:{port}", token=token)),
                loop.run_in_executor(None, lambda: _probe_cli("grpc", f"127.0.0.1:{port}", token="nope")))
        finally:
            await server.stop(None)
        return ok, denied, cli_ok, cli_denied

    ok, denied, cli_ok, cli_denied = arun(scenario(), timeout=90)
    assert ok is None
    assert denied is not None and denied.startswith("UNAUTHENTICATED")
    assert cli_ok.returncode == 0, cli_ok.stderr
    assert cli_denied.returncode == 1 and "UNAUTHENTICATED" in cli_denied.stderr


def test_probe_usage_errors_exit_2():
    assert _probe_cli("ftp://x").returncode == 2
    assert _probe_cli("grpc").returncode == 2
