"""The fork server outlives its agent: it hands its workers to the next agent, or fences them.

Real helper processes (``python -m podium.worker.agent.forkhelper``) and real forked workers;
the agent's death is its end of the socket closing without ``{"stop": true}``, which is what
the kernel does for a SIGKILLed agent. The agent's side of adoption (``Spawner.adopt``) runs
in ``tests/cluster/test_agent_restart.py`` against real ``podium node`` processes.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from podium.process import start_time
from podium.worker.agent import forkserver
from tests.support.proctable import alive

pytestmark = pytest.mark.timeout(300)


def serving_env(worker_id: str) -> dict[str, str]:
    """The environment of a worker that serves until it is stopped."""
    return {"PATH": os.environ.get("PATH", ""), "RANK": "0", "WORLD_SIZE": "1",
            "PODIUM_WORKER_ID": worker_id, "PODIUM_TOKEN": "t" * 32, "PODIUM_NODE_ADDRESS": "127.0.0.1"}


#: Read ends of the workers' ready pipes: a worker whose pipe is closed fails its ready write.
READY_PIPES: list[int] = []


@pytest.fixture(autouse=True)
def close_ready_pipes():
    yield
    while READY_PIPES:
        os.close(READY_PIPES.pop())


async def spawn(server: forkserver.ForkServer, tmp_path, worker_id: str) -> forkserver.ForkedProcess:
    log = os.open(tmp_path / f"{worker_id}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    r, w = os.pipe()
    READY_PIPES.append(r)
    try:
        child = await server.spawn(serving_env(worker_id), str(tmp_path), (w, log, log), ["podium.worker.host"])
    finally:
        for fd in (log, w):
            os.close(fd)
    await until(lambda: _readable(r), f"worker {worker_id} to serve")
    return child


def _readable(fd: int) -> bool:
    import select
    return bool(select.select([fd], [], [], 0)[0])


def die(server: forkserver.ForkServer) -> None:
    """The agent's end of the socket closes with no stop message, as when it is SIGKILLed."""
    server._lost()


async def until(predicate, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_a_restarted_agent_gets_the_workers_their_records_and_the_exits_it_missed(tmp_path):
    listen = tmp_path / forkserver.LISTEN_NAME

    async def scenario() -> None:
        first = forkserver.ForkServer(dict(os.environ), tmp_path / "forkserver.log", listen=listen)
        first.start()
        assert await first.wait_ready(180) and not first.adopted
        kept, lost, starting = [await spawn(first, tmp_path, f"w-{n}") for n in ("kept", "lost", "starting")]
        for child in (kept, lost):
            first.notify({"record": child.pid, "meta": {"id": f"of {child.pid}"}})
        first.notify({"fence_at": time.monotonic() + 120})
        await asyncio.sleep(0.2)  # bookkeeping messages are not answered: let the helper read them
        die(first)
        os.kill(lost.pid, 9)  # ends while no agent holds the helper
        await until(lambda: start_time(lost.pid) is None, "the lost worker reaped by the helper")

        second = forkserver.ForkServer(dict(os.environ), tmp_path / "forkserver.log", listen=listen)
        second.start()
        try:
            assert second.adopted and second.pid == first.pid
            assert await second.wait_ready(30)
            by_pid = {e["pid"]: e for e in second.adoptable}
            assert set(by_pid) == {kept.pid, lost.pid, starting.pid}
            assert by_pid[kept.pid]["meta"] == {"id": f"of {kept.pid}"}
            assert by_pid[kept.pid]["start"] == start_time(kept.pid) and "code" not in by_pid[kept.pid]
            assert by_pid[lost.pid]["code"] == -9
            assert by_pid[starting.pid]["meta"] is None  # no record: the agent kills it
            assert second.inherited_fence_at is not None
            # The helper reports to its new agent: an adopted worker's exit arrives as any.
            adopted = second.adopt(kept.pid)
            os.kill(kept.pid, 9)
            await until(lambda: adopted.poll() is not None, "the adopted worker's exit")
            assert adopted.poll() == -9
        finally:
            await second.close()
        await until(lambda: not alive(second.pid), "the helper gone after an orderly stop")
        await until(lambda: not alive(starting.pid), "the unrecorded worker gone with its helper")
        assert not listen.exists()

    asyncio.run(scenario())


def test_a_helper_nobody_adopts_kills_its_workers_at_the_fence_deadline(tmp_path):
    listen = tmp_path / forkserver.LISTEN_NAME

    async def scenario() -> None:
        server = forkserver.ForkServer(dict(os.environ), tmp_path / "forkserver.log", listen=listen)
        server.start()
        assert await server.wait_ready(180)
        children = [await spawn(server, tmp_path, f"w-{n}") for n in range(2)]
        server.notify({"fence_at": time.monotonic() + 1.0})
        await asyncio.sleep(0.2)
        helper = server.pid
        die(server)
        assert all(alive(c.pid) for c in children)  # kept for a restarted agent meanwhile
        await until(lambda: not any(alive(c.pid) for c in children), "the workers fenced")
        await until(lambda: not alive(helper), "the helper gone")
        assert not listen.exists()
        log = (tmp_path / "forkserver.log").read_text()
        assert "killing 2 worker(s)" in log, log[-2000:]

    asyncio.run(scenario())


def test_without_a_lease_an_orphaned_helper_keeps_nothing(tmp_path):
    """An agent that never registered has no fence deadline to wait for: its workers go at once."""
    async def scenario() -> None:
        server = forkserver.ForkServer(dict(os.environ), tmp_path / "forkserver.log",
                                       listen=tmp_path / forkserver.LISTEN_NAME)
        server.start()
        assert await server.wait_ready(180)
        child = await spawn(server, tmp_path, "w-0")
        die(server)
        await until(lambda: not alive(child.pid), "the worker killed")

    asyncio.run(scenario())
