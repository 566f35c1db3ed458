"""What a client with no token can hold of a real worker process (issue #34), driven as an
attacker would: raw sockets that connect and never speak, to the raw call port and to the
gRPC port, with the worker's descriptor limit lowered (``prlimit``) so that exhaustion would
show. Meanwhile a client with the token must get in at once.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import threading

import pytest

from podium.transport import preauth
from podium.worker.caller.client import WorkerClient

from tests.support.processes import spawn_worker
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(240)


class Counter:
    def add(self, a: int, b: int) -> int:
        return a + b


@pytest.fixture
def worker(tmp_path, token):
    proc = spawn_worker(tmp_path, token)
    yield proc
    proc.stop()


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled_fds(pid: int) -> int:
    """The descriptor count once closed connections are gone (two equal reads in a row)."""
    prev = fds(pid)
    for _ in range(100):
        threading.Event().wait(0.2)
        now = fds(pid)
        if now == prev:
            return now
        prev = now
    raise AssertionError("the worker's descriptor count never settled")


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def limit_fds(pid: int, n: int) -> None:
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (n, n))


def idle_sockets(port: int, n: int) -> list[socket.socket]:
    """``n`` connections to ``port`` that never send a byte."""
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (what it sent before, e.g. gRPC's SETTINGS, is read
    and dropped)."""
    sock.setblocking(False)
    try:
        while sock.recv(4096):
            pass
        return True  # EOF
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


async def authenticated_call(address: str, token: str) -> int:
    client = WorkerClient(address, token)
    try:
        info = await client.start(timeout=10)
        if not info.constructed:
            await client.construct((Counter, (), {}))
        return await client.call("add", (2, 3), timeout=10)
    finally:
        await client.close()


def test_600_idle_raw_connections_cost_one_descriptor_each_and_lock_nobody_out(worker, token, arun):
    assert arun(authenticated_call(worker.address, token)) == 5
    call_port = arun(_call_port(worker.address, token))
    pid = worker.proc.pid
    limit_fds(pid, 1024)
    before_fds, before_rss = settled_fds(pid), rss_kib(pid)

    # Per-connection cost before authentication: one descriptor and a few KiB.
    held = idle_sockets(call_port, preauth.PER_PEER)
    try:
        eventually(lambda: fds(pid) - before_fds >= preauth.PER_PEER, timeout=30, what="connections accepted")
        assert fds(pid) - before_fds == preauth.PER_PEER  # no second descriptor per connection
        grown = rss_kib(pid) - before_rss
        assert grown <= preauth.PER_PEER * 8, f"{grown} KiB for {preauth.PER_PEER} idle connections"

        # 600 in all: the worker keeps at most PER_PEER of one peer, closing the oldest.
        held += idle_sockets(call_port, 600 - preauth.PER_PEER)
        eventually(lambda: sum(closed_by_peer(s) for s in held) >= 600 - preauth.PER_PEER, timeout=60,
                   what="the oldest idle connections evicted")
        assert fds(pid) - before_fds <= preauth.PER_PEER + 2
        # A client with the token gets in at once, on the raw socket and on gRPC.
        assert arun(authenticated_call(worker.address, token)) == 5
        assert not any(closed_by_peer(s) for s in held[-preauth.PER_PEER + 1:])  # the newest are kept
    finally:
        for sock in held:
            sock.close()
    # And a connection that never says hello is closed at the handshake deadline.
    late = idle_sockets(call_port, 1)[0]
    try:
        eventually(lambda: closed_by_peer(late), timeout=60, what="an idle connection closed at its deadline")
    finally:
        late.close()


def test_authenticated_clients_get_in_while_an_attacker_reopens_every_closed_connection(worker, token, arun):
    call_port = arun(_call_port(worker.address, token))
    limit_fds(worker.proc.pid, 1024)
    stop = threading.Event()
    opened = [0]

    def attacker() -> None:  # keeps 600 never-speaking connections open, re-opening each closed one
        socks = idle_sockets(call_port, 600)
        try:
            while not stop.is_set():
                for i, sock in enumerate(socks):
                    if closed_by_peer(sock):
                        sock.close()
                        with contextlib.suppress(OSError):
                            socks[i] = socket.create_connection(("127.0.0.1", call_port), timeout=10)
                            opened[0] += 1
                stop.wait(0.01)
        finally:
            for sock in socks:
                sock.close()

    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    try:
        eventually(lambda: opened[0] > 0, timeout=60, what="the attacker re-opening connections")
        results = [arun(authenticated_call(worker.address, token)) for _ in range(10)]
    finally:
        stop.set()
        thread.join(timeout=60)
    assert results == [5] * 10
    assert fds(worker.proc.pid) < 1024


def test_never_handshaking_grpc_connections_are_dropped_at_the_handshake_deadline(worker, token, arun):
    pid = worker.proc.pid
    limit_fds(pid, 256)
    held = []
    try:
        for _ in range(300):  # more than the worker has descriptors for
            with contextlib.suppress(OSError):
                held.append(socket.create_connection(("127.0.0.1", worker.port), timeout=10))
        eventually(lambda: all(closed_by_peer(s) for s in held), timeout=90,
                   what="idle gRPC connections closed by the server")
        # Then a client with the token works again, at once.
        assert arun(authenticated_call(worker.address, token)) == 5
    finally:
        for sock in held:
            sock.close()


def test_a_worker_raises_its_soft_descriptor_limit_and_says_so(tmp_path, token):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Low, but above what this (long-running) test process already holds.
    low = len(os.listdir("/proc/self/fd")) + 64
    if hard != resource.RLIM_INFINITY and hard <= 2 * low:
        pytest.skip(f"the hard limit here ({hard}) leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))  # inherited by the worker
    try:
        proc = spawn_worker(tmp_path, token)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        assert resource.prlimit(proc.proc.pid, resource.RLIMIT_NOFILE)[0] == hard
        assert f"RLIMIT_NOFILE: raised the soft limit from {low} to the hard limit {hard}" in proc.log()
    finally:
        proc.stop()


async def _call_port(address: str, token: str) -> int:
    client = WorkerClient(address, token)
    try:
        info = await client.start(timeout=10)
        assert info.call_port
        return info.call_port
    finally:
        await client.close()
