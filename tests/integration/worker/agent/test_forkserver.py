"""Workers forked by the node agent's fork server behave like exec'd ones.

Through the embedded cluster (real scheduler, agent, fork server and worker processes):
each forked worker has its own session, its own CUDA_VISIBLE_DEVICES and RANK, its stdout
and stderr in its own log files, a parent-death signal, a numpy RNG of its own; its exit
code and signal reach the controller; they die with the fork server (parent-death signal;
the agent reports them and execs later workers); and ``PODIUM_FORKSERVER=0`` starts
workers the exec way.
"""

from __future__ import annotations

import os
import signal

import pytest

import podium
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.errors import WorkerDiedError
from podium.worker import Dispatch, Worker, register
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(240)


class Probe(Worker):
    """Reports how its process was set up; can exit or die on request."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def facts(self):
        import numpy as np

        print(f"stdout of rank {self.rank}", flush=True)
        os.write(2, f"stderr of rank {self.rank}\n".encode())
        return {"pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0), "ppid": os.getppid(),
                "rank": os.environ["RANK"], "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "forked": "PODIUM_FORKED_AT" in os.environ,
                "stdout": os.readlink("/proc/self/fd/1"), "stderr": os.readlink("/proc/self/fd/2"),
                "stdin": os.readlink("/proc/self/fd/0"), "random": int(np.random.randint(0, 2**62)),
                "cwd": os.getcwd()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def modules(self):
        import sys

        return sorted(sys.modules)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def exit_with(self, code):
        os._exit(code)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def die_by(self, signum):
        # To the calling thread, as a real crash's signal is: os.kill(getpid(), SIGSEGV) goes
        # to the process, which dumps core on another thread while this one returns and answers.
        signal.raise_signal(signum)


def group(n: int) -> WorkerGroup:
    return WorkerGroup(ResourcePool([n], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Probe))


def wait_forkserver_ready(rt, seconds: float = 180.0) -> None:
    """Until the agent's fork server has done its imports (its log says so)."""
    path = os.path.join(rt.log_dir, "workers", "forkserver.log")
    eventually(lambda: os.path.exists(path) and " ready " in open(path).read(),
               f"the fork server to get ready ({path})", seconds, interval=0.1)


@pytest.fixture(scope="module")
def forkserver_cluster():
    rt = podium.init(log_to_driver=False)
    wait_forkserver_ready(rt)
    yield
    podium.shutdown()


def test_forked_workers_are_set_up_like_exec_ones(forkserver_cluster):
    wg = group(3)
    try:
        facts = wg.facts()
        assert all(f["forked"] for f in facts)
        assert [f["rank"] for f in facts] == ["0", "1", "2"]
        assert len({f["cuda"] for f in facts}) == 3 and all(f["cuda"] is not None for f in facts)
        for f, w in zip(facts, wg.workers):
            assert f["pid"] == w.pid == f["sid"] == f["pgid"]  # own session and process group
            assert f["stdout"].endswith(".out") and f["stderr"].endswith(".err") and f["stdout"] != f["stderr"]
            assert f["stdin"] == "/dev/null" and f["cwd"] == os.getcwd()
            with open(f["stdout"]) as out, open(f["stderr"]) as err:
                assert f"stdout of rank {f['rank']}" in out.read()
                assert f"stderr of rank {f['rank']}" in err.read()
        assert len({f["ppid"] for f in facts}) == 1  # the one fork server
        assert len({f["random"] for f in facts}) == 3  # numpy reseeded in each child
    finally:
        wg.shutdown()


def test_a_forked_worker_imports_nothing_after_the_fork_but_the_users_code(forkserver_cluster):
    """Every module a worker needs to start, serve and build its object comes from the fork
    server (shared pages): one imported after the fork costs its import in each of a node's
    workers (encodings.idna and podium.worker.factory did: ~0.5 s of CPU for 128 workers)."""
    import subprocess
    import sys

    from podium.worker.agent.forkserver import PRELOAD

    wg = group(1)
    try:
        wg.facts()  # a call with a payload and a reply, as every worker makes
        in_worker = set(wg.modules()[0])
    finally:
        wg.shutdown()
    # The fork server runs as ``python -m podium.worker.agent.forkhelper``: its package too.
    preload = "import sys\nfor name in %r: __import__(name)\nprint(' '.join(sys.modules))" % (
        ("podium.worker.agent.forkhelper", *PRELOAD),)
    in_server = set(subprocess.run([sys.executable, "-c", preload], capture_output=True, text=True,
                                   check=True, timeout=120).stdout.split())
    after_fork = {name for name in in_worker - in_server if not name.startswith("tests")}
    assert not after_fork, sorted(after_fork)


def test_exit_code_and_signal_of_forked_workers_reach_the_controller(forkserver_cluster):
    wg = group(2)
    try:
        with pytest.raises(WorkerDiedError) as caught:
            wg.exit_with(7)
        assert caught.value.exit_code == 7 and not caught.value.signal
    finally:
        wg.shutdown()
    wg = group(1)
    try:
        with pytest.raises(WorkerDiedError) as caught:
            wg.die_by(signal.SIGSEGV)
        assert caught.value.signal == signal.SIGSEGV
    finally:
        wg.shutdown()


def test_workers_die_with_the_fork_server_and_later_ones_are_execed(forkserver_cluster):
    wg = group(2)
    try:
        facts = wg.facts()
        helper = facts[0]["ppid"]
        os.kill(helper, signal.SIGKILL)
        eventually(lambda: not any(os.path.exists(f"/proc/{f['pid']}") for f in facts),
                   "the workers to die with their fork-server parent (PR_SET_PDEATHSIG)", 30)
        with pytest.raises(WorkerDiedError) as caught:
            wg.facts()
        assert caught.value.signal == signal.SIGKILL
    finally:
        wg.shutdown()
    wg = group(1)
    try:
        assert not wg.facts()[0]["forked"]
    finally:
        wg.shutdown()


def test_exec_when_the_fork_server_is_off(monkeypatch):
    podium.shutdown()  # the module's cluster, if any, is restarted by the next test's fixture
    monkeypatch.setenv("PODIUM_FORKSERVER", "0")
    podium.init(log_to_driver=False)
    try:
        wg = group(2)
        try:
            facts = wg.facts()
            assert not any(f["forked"] for f in facts)
            assert all(f["pid"] == f["sid"] for f in facts)
        finally:
            wg.shutdown()
    finally:
        podium.shutdown()
    import gc
    assert gc.get_freeze_count() == 0  # init() froze the import-time heap; shutdown() gave it back


def test_a_burst_of_spawns_is_all_forked_even_when_the_socket_is_full(tmp_path):
    """Requests sent back to back fill the socket to the helper; each waits for room
    (none is refused with EAGAIN and exec'd instead, which cost a torch import each)."""
    import asyncio
    import socket

    from podium.worker.agent.forkserver import ForkServer

    async def burst() -> list:
        server = ForkServer(dict(os.environ), tmp_path / "forkserver.log")
        server.start()
        try:
            assert await server.wait_ready(180)
            # The smallest buffer the kernel allows: a handful of requests fill it.
            server._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
            env = {"PATH": os.environ.get("PATH", ""), "PODIUM_PADDING": "x" * 1024}
            log = os.open(tmp_path / "child.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            pipes = [os.pipe() for _ in range(40)]
            try:
                children = await asyncio.gather(*(
                    server.spawn(env, str(tmp_path), (w, log, log), ["podium.worker.host"])
                    for _, w in pipes))
            finally:
                os.close(log)
                for r, w in pipes:
                    os.close(r)
                    os.close(w)
            # Without a worker environment each child's host exits at once, with a code.
            for _ in range(600):
                if all(child.poll() is not None for child in children):
                    break
                await asyncio.sleep(0.05)
            return children
        finally:
            await server.close()

    children = asyncio.run(burst())
    assert len({child.pid for child in children}) == 40
    assert all(child.poll() not in (None, 0) for child in children), [c.poll() for c in children]


def test_a_child_forked_after_its_request_gave_up_is_killed(tmp_path, monkeypatch):
    """A spawn that stops waiting for the helper's answer falls back to exec; the child the
    helper forks anyway must not live on unmanaged."""
    import asyncio
    import signal as signals

    from podium.worker.agent import forkserver

    async def late() -> dict:
        server = forkserver.ForkServer(dict(os.environ), tmp_path / "forkserver.log")
        server.start()
        try:
            assert await server.wait_ready(180)
            monkeypatch.setattr(forkserver, "_REQUEST_SECONDS", 0.0)
            # A worker that would serve until told to stop if left alone.
            env = {"PATH": os.environ.get("PATH", ""), "RANK": "0", "WORLD_SIZE": "1",
                   "PODIUM_WORKER_ID": "w-late", "PODIUM_TOKEN": "t" * 32}
            log = os.open(tmp_path / "child.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            r, w = os.pipe()
            try:
                with pytest.raises(OSError, match="did not answer"):
                    await server.spawn(env, str(tmp_path), (w, log, log), ["podium.worker.host"])
            finally:
                for fd in (log, r, w):
                    os.close(fd)
            for _ in range(300):  # its exit, reported by the helper, for a pid nobody asked for
                if server._early_exits:
                    break
                await asyncio.sleep(0.05)
            return dict(server._early_exits)
        finally:
            await server.close()

    exits = asyncio.run(late())
    assert list(exits.values()) == [-signals.SIGKILL], (exits, (tmp_path / "child.log").read_text()[-2000:])
