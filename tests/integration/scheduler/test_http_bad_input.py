"""The scheduler's HTTP endpoints under bad paths, methods, bodies and credentials.

Every answer is a deliberate status with a JSON ``{"error": ...}`` body (or aiohttp's
own 4xx for bytes that are not HTTP), nothing is ever served without the token but
/healthz and /readyz, and the endpoints keep serving afterwards.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from podium.scheduler.server import run_scheduler
from tests.support.scheduler_fakes import config

pytestmark = pytest.mark.faults

PROTECTED = ("/v1/nodes", "/v1/placement", "/v1/workers", "/metrics")
OPEN = ("/healthz", "/readyz", "/")  # "/": the dashboard page (its data needs the token)
METHODS = ("POST", "PUT", "DELETE", "PATCH")


async def _request(http, method, url, **kwargs):
    async with http.request(method, url, **kwargs) as resp:
        return resp.status, await resp.read()


def _error_json(body: bytes) -> str:
    doc = json.loads(body)
    assert set(doc) == {"error"} and doc["error"], doc
    return doc["error"]


async def _raw(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(4096), 10)
    finally:
        writer.close()


def test_http_bad_paths_methods_bodies_and_tokens(token, arun):
    async def scenario():
        running = await run_scheduler(config(token))
        base = running.http_url
        auth = {"Authorization": f"Bearer {token}"}
        try:
            async with aiohttp.ClientSession() as http:
                # No or wrong token: 401 on every protected path, any method, and on unknown
                # paths too (no probing for what exists).
                for headers in ({}, {"Authorization": f"Bearer {token}x"}, {"Authorization": token},
                                {"Authorization": f"Basic {token}"}):
                    for path in (*PROTECTED, "/v1/nope", "/admin", "/v1/placement/../nodes"):
                        for method in ("GET", *METHODS):
                            status, body = await _request(http, method, base + path, headers=headers,
                                                          data=b'{"x": 1}')
                            assert status == 401, (method, path, headers, status)
                            assert "token" in _error_json(body)
                            assert token.encode() not in body
                # Open paths need no token and change nothing whatever the method.
                for path in OPEN:
                    assert (await _request(http, "GET", base + path))[0] == 200
                    for method in METHODS:
                        status, body = await _request(http, method, base + path, data=b"\x00" * 1000)
                        assert status == 405 and "not allowed" in _error_json(body)
                # With the token: unknown paths 404, wrong methods 405, bodies ignored or refused.
                for path in ("/v1/nope", "/v1/nodes/extra", "/%ff%fe", "/v1/" + "x" * 2000, "/v1/nodes/../nope"):
                    status, body = await _request(http, "GET", base + path, headers=auth)
                    assert status == 404, (path, status)
                    assert "no such path" in _error_json(body)
                for path in PROTECTED:
                    for method in METHODS:
                        status, body = await _request(http, method, base + path, headers=auth,
                                                      data=b"\xff\xfe not json {{{")
                        assert status == 405 and method in _error_json(body), (method, path)
                    status, body = await _request(http, "GET", base + path, headers=auth,
                                                  data=b"ignored body", params={"x": "\u2603", "y": ""})
                    assert status == 200, (path, status)
                # A body above aiohttp's limit is refused without being buffered in full.
                status, _ = await _request(http, "POST", base + "/v1/nodes", headers=auth,
                                           data=b"x" * (4 << 20))
                assert status in (405, 413)
            # Bytes that are not HTTP get aiohttp's 400, and the server lives on.
            for junk in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32 + b"\r\n\r\n",
                         b"GARBAGE\r\n\r\n", b"GET /healthz HTTP/9.9\r\n\r\n",
                         b"GET /healthz HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                         b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n"):
                reply = await _raw(running.http_port, junk)
                assert reply == b"" or reply.startswith(b"HTTP/1.") and b" 4" in reply[:13], reply[:80]
            async with aiohttp.ClientSession() as http:
                assert (await _request(http, "GET", base + "/healthz"))[0] == 200
                status, body = await _request(http, "GET", base + "/v1/nodes", headers=auth)
                assert status == 200 and "nodes" in json.loads(body)
        finally:
            await running.stop(0)
    arun(scenario())


def test_generated_http_requests_never_fail_the_server(token):
    """Hypothesis: any path, method, Authorization header and body gets a deliberate answer
    (never a 500), nothing protected is served without the token, and the server lives on."""
    from urllib.parse import quote

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    # One loop for the server and the client session; hypothesis drives it example by example.
    loop = asyncio.new_event_loop()
    running = loop.run_until_complete(run_scheduler(config(token)))
    session = loop.run_until_complete(_session())
    segment = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)

    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(parts=st.lists(st.one_of(segment, st.sampled_from(["v1", "nodes", "placement", "..", "metrics"])),
                          max_size=4),
           method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
           auth=st.one_of(st.none(), st.just(f"Bearer {token}"), st.text(max_size=40)),
           body=st.binary(max_size=256))
    def check(parts, method, auth, body):
        path = "/" + "/".join(quote(p, safe="") for p in parts)
        headers = {"Authorization": auth} if auth is not None and auth.isprintable() else {}
        status, data = loop.run_until_complete(
            _request(session, method, running.http_url + path, headers=headers, data=body))
        assert status < 500, (method, path, status, data[:200])
        if status == 200 and method != "HEAD":
            assert headers.get("Authorization") == f"Bearer {token}" or path in ("/", "/healthz", "/readyz"), \
                (method, path)
        assert token.encode() not in data

    try:
        check()
        assert loop.run_until_complete(_request(session, "GET", running.http_url + "/healthz"))[0] == 200
    finally:
        loop.run_until_complete(session.close())
        loop.run_until_complete(running.stop(0))
        loop.close()


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession()  # made on the loop that uses it
