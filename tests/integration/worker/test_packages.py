"""Package URIs in a runtime_env (podium.worker.agent.packages): a ``gcs://`` package read from
the scheduler's real ``Packages`` service (token-checked gRPC on port 0) and an ``https://`` zip
from a local aiohttp server with its own CA, each unpacked once into the node's private cache;
a wrong token, a package never uploaded and an unreachable URL are SetupFailed errors that
leave nothing behind; the launcher puts the unpacked folders where Ray does."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
from aiohttp import web

from podium import rpc
from podium.scheduler import packageserve
from podium.scheduler.jobpackages import PackageStore
from podium.runtimeenv import SETUP_FAILED_EXIT
from podium.worker.agent import envlauncher, packages
from podium.worker.agent.pipenv import SetupFailed
from tests.support.certs import make_tls

pytestmark = pytest.mark.timeout(120)

NAME = "_ray_pkg_0123456789abcdef0123.zip"
URI = f"gcs://{NAME}"


def _zip(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()


class _Loop:
    """An event loop in a thread, serving while the test calls the blocking fetch."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def loop():
    running = _Loop()
    yield running
    running.close()


@pytest.fixture
def scheduler(tmp_path, loop):
    store = PackageStore(tmp_path / "store")
    store.put("gcs", NAME, _zip({"wd_module.py": "VALUE = 40\n", "data/x.txt": "x"}))

    async def serve():
        server, health = rpc.make_server("s3cret")
        packageserve.add_to_server(server, store)
        port = rpc.bind(server, "127.0.0.1", 0)
        await rpc.start_server(server, health)
        return server, f"127.0.0.1:{port}"

    server, address = loop.run(serve())
    yield address
    loop.run(server.stop(0))


def test_a_gcs_package_is_read_with_the_token_and_unpacked_once(tmp_path, scheduler, capsys):
    cache = tmp_path / "cache"
    env = {"PODIUM_SCHEDULER": scheduler, "PODIUM_TOKEN": "s3cret"}
    folder, fd = packages.fetch(cache, URI, env)
    os.close(fd)
    assert Path(folder, "wd_module.py").read_text() == "VALUE = 40\n" and Path(folder, "data/x.txt").exists()
    assert Path(folder).parent == cache and (cache.stat().st_mode & 0o777) == 0o700
    assert capsys.readouterr().err.count("fetched") == 1
    again, fd = packages.fetch(cache, URI, {})  # cached: the scheduler is not asked again
    os.close(fd)
    assert again == folder and "fetched" not in capsys.readouterr().err
    with pytest.raises(SetupFailed, match="UNAUTHENTICATED|token"):
        packages.fetch(tmp_path / "other", URI, {**env, "PODIUM_TOKEN": "wrong"})
    missing = "gcs://_ray_pkg_ffffffffffffffff.zip"
    with pytest.raises(SetupFailed, match="does not exist on this cluster"):
        packages.fetch(tmp_path / "other", missing, env)
    assert [p.name for p in (tmp_path / "other").iterdir() if not p.name.endswith(".lock")] == []


def test_an_https_zip_is_fetched_with_aiohttp_and_its_failures_are_named(tmp_path, loop):
    tls = make_tls(tmp_path / "tls")
    body = _zip({"https_pkg/__init__.py": "VALUE = 2\n"})
    hits = []

    async def serve():
        async def package(request):
            hits.append(request.path)
            return web.Response(body=body) if request.path == "/m.zip" else web.Response(status=404)
        app = web.Application()
        app.router.add_get("/{name}", package)
        runner = web.AppRunner(app)
        await runner.setup()
        import ssl
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tls.cert, tls.key)
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    runner, port = loop.run(serve())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["SSL_CERT_FILE"] = tls.ca  # the worker's process trusts the test's CA (OpenSSL reads it)
    probe = "import https_pkg; print(https_pkg.VALUE)"
    try:
        for _ in range(2):  # the second worker finds it unpacked
            command = envlauncher.launcher_command(tmp_path, None, "", [f"https://127.0.0.1:{port}/m.zip"])
            run = subprocess.run([*command, sys.executable, "-c", probe], env=env, capture_output=True, text=True)
            assert run.returncode == 0 and run.stdout.strip() == "2", run.stderr
        command = envlauncher.launcher_command(tmp_path, None, f"https://127.0.0.1:{port}/absent.zip", [])
        run = subprocess.run([*command, sys.executable, "-c", "print('never')"], env=env, capture_output=True, text=True)
        assert run.returncode == SETUP_FAILED_EXIT and "HTTP 404" in run.stderr
        with pytest.raises(SetupFailed, match="GET https://127.0.0.1.*CERTIFICATE_VERIFY_FAILED"):
            packages.fetch(tmp_path / "cache2", f"https://127.0.0.1:{port}/m.zip", {})  # not trusted here
    finally:
        loop.run(runner.cleanup())
    assert hits.count("/m.zip") == 1  # fetched once; the untrusted try never got a response
    assert [p.name for p in (tmp_path / "cache2").iterdir() if not p.name.endswith(".lock")] == []


def test_the_launcher_enters_an_unpacked_working_dir_and_puts_modules_on_the_path(tmp_path, scheduler):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PODIUM_SCHEDULER=scheduler, PODIUM_TOKEN="s3cret")
    command = envlauncher.launcher_command(tmp_path, None, URI, [URI])
    probe = "import os, sys, wd_module; print(os.getcwd()); print(wd_module.VALUE)"
    run = subprocess.run([*command, sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    cwd, value = run.stdout.split()
    assert cwd == str(tmp_path / packages.CACHE_DIR / packages.cache_key(URI)) and value == "40"
    bad = envlauncher.launcher_command(tmp_path, None, "gcs://_ray_pkg_ffffffffffffffff.zip", [])
    run = subprocess.run([*bad, sys.executable, "-c", "print('never')"], env=env, capture_output=True, text=True)
    assert run.returncode == SETUP_FAILED_EXIT and "could not be set up" in run.stderr and "does not exist" in run.stderr
    assert json.loads(command[4])["working_dir"] == URI
