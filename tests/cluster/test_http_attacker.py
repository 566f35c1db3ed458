"""Issue #34, items 1 and 4, as an attacker without the token drives them against a real
``podium scheduler`` process whose descriptor limit is lowered to 256 (``prlimit``): silent
connections re-opened as fast as they are closed must not fail a single /healthz or /readyz
probe nor an authenticated call, and an endless chunked body is cut off, not read."""

from __future__ import annotations

import asyncio
import os
import resource

import pytest

from podium import httplimits
from podium.scheduler.client import SchedulerClient
from tests.support.httpattack import SilentFlood, endless_chunked_post, probe

pytestmark = [pytest.mark.cluster, pytest.mark.faults]

FD_LIMIT = 256
PROBES = 30
#: More attacking connections than the scheduler's whole HTTP cap.
LANES = 3 * httplimits.HTTP_MAX_CONNECTIONS


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize("first", [b"", b"G"], ids=["silent", "one-byte"])
def test_probes_and_token_calls_are_answered_while_silent_connections_flood_the_port(
        scheduler_process, token, arun, first):
    sched = scheduler_process()
    pid = sched.proc.pid
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
    host, port = sched.host, sched.http_port
    base_fds = _fds(pid)

    async def scenario():
        client = SchedulerClient(sched.address, token=token)
        try:
            async with SilentFlood(host, port, LANES, first=first) as flood:
                # The attack is under way: the cap is full and connections churn.
                while flood.closed_by_server < LANES:
                    await asyncio.sleep(0.05)
                answers, most_fds = [], 0
                for i in range(PROBES):
                    path = "/healthz" if i % 2 == 0 else "/readyz"
                    answers.append((path, await probe(host, port, path)))
                    most_fds = max(most_fds, _fds(pid))
                    await asyncio.sleep(0.1)
                authed = await probe(host, port, "/v1/nodes", token=token)
                state = await asyncio.wait_for(client.cluster_state(), 30)
            print(f"\n{flood.opened} silent connections opened, {flood.closed_by_server} closed by the "
                  f"scheduler; probes {[s for _, s in answers]}; descriptors {base_fds} -> at most "
                  f"{most_fds} (limit {FD_LIMIT})")
            assert [s for _, s in answers] == [200] * PROBES, answers
            assert authed == 200
            assert state.scheduler_id
            # The descriptor bound of #14 holds: the cap plus a few closing at once.
            assert most_fds <= base_fds + httplimits.HTTP_MAX_CONNECTIONS + 32
        finally:
            await client.close()
    arun(scenario(), timeout=240)


def test_an_endless_chunked_body_is_cut_off_with_413_and_the_scheduler_serves_on(
        scheduler_process, token, arun):
    sched = scheduler_process()
    host, port = sched.host, sched.http_port
    limit = 256 << 20
    for path in ("/healthz", "/v1/nodes"):  # an open path, and one that needs the token
        status, sent = endless_chunked_post(host, port, path, limit)
        print(f"\nchunked POST {path}: {status!r} after {sent >> 10} KiB sent")
        assert status.startswith(b"HTTP/1.1 413"), status
        assert sent < 16 << 20  # never read on: what the sockets' buffers took, at most

    async def after():
        assert await probe(host, port, "/healthz") == 200
        assert await probe(host, port, "/v1/nodes", token=token) == 200
    arun(after(), timeout=60)
