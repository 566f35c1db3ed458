"""The fork server's own process: preload, fork workers, reap them, keep them for a restarted agent.

``python -m podium.worker.agent.forkhelper --fd N [--listen PATH]`` is what
:class:`podium.worker.agent.forkserver.ForkServer` starts (its docstring has the protocol and
why a fork server exists). This module is the other end: a single-threaded loop that forks a
worker per request, reaps its children and reports their exits.

It is also what lets workers outlive a crashed agent. The helper is the workers' parent, not
the agent, so a SIGKILLed agent (an OOM kill, a crash, ``systemctl kill``) takes no worker
with it. With ``--listen PATH`` (a socket in the agent's private log folder) the helper then
waits for the agent's next incarnation to connect and re-adopt them, reaping and recording
their exits meanwhile. It waits only until the fence deadline the agent last sent
(``{"fence_at": t}``, ``time.monotonic()``, the same clock in every process): the moment by
which the node's workers must be gone because the scheduler may declare the node dead and
place its ranks elsewhere (:mod:`podium.worker.agent.link`). No agent by then: it SIGKILLs
every child and exits, so a dead agent can never leave a rank live twice. An agent that stops
in order says ``{"stop": true}`` first; the helper then exits and its children die with it
(``PR_SET_PDEATHSIG``). Without ``--listen`` the helper dies with the agent as before.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
import traceback

from podium.process import start_time
from podium.worker.masterstore import LISTEN_FD_ENV

__all__ = ["PRELOAD", "MAX_MESSAGE", "serve", "main"]

#: Modules the helper imports before it forks anything (missing ones are skipped).
PRELOAD = ("podium.worker.host.process", "podium.worker.base", "podium.dataproto", "uvloop", "numpy",
           "torch", "tensordict",
           # What every worker imported after the fork: the constructor's class resolver and
           # the IDNA codec (Python's socket code encodes host names with it). ~4 ms each,
           # so ~0.5 s of CPU for 128 workers on one node.
           "podium.worker.factory", "encodings.idna")

_PR_SET_PDEATHSIG = 1
#: Largest message either side sends (a spawn request carries a whole worker environment).
MAX_MESSAGE = 1 << 20


def _send(sock: socket.socket | None, message: dict) -> bool:
    """Send one message to the agent; False when there is none or it is gone."""
    if sock is None:
        return False
    try:
        sock.send(json.dumps(message).encode())
        return True
    except OSError:
        return False


def _preload() -> list[str]:
    loaded = []
    for name in PRELOAD:
        try:
            __import__(name)
            loaded.append(name)
        except Exception:  # noqa: BLE001 - an optional module missing or broken: workers import it themselves
            pass
    return loaded


def _child(request: dict, fds: list[int], close: list[int], parent: int) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    try:
        os.setsid()
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the helper died in between
            os._exit(1)
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        ready_fd, out_fd, err_fd = fds[:3]
        for fd in close:
            with contextlib.suppress(OSError):
                os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        for fd in (devnull, out_fd, err_fd):
            if fd > 2:
                os.close(fd)
        os.chdir(request.get("cwd") or "/")
        os.environ.clear()
        os.environ.update(request["env"])
        if len(fds) == 4:  # a group master's MASTER_PORT socket, bound by the agent
            os.environ[LISTEN_FD_ENV] = str(fds[3])
        os.environ["PODIUM_FORKED_AT"] = repr(time.time())
        # The helper read PYTHONPATH when it started; a worker's own (its spec's env, e.g. the
        # `ray` stand-in of `podium run`) must still come first on its path, as after an exec.
        for entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path:
                sys.path.insert(0, entry)
        sys.argv = list(request.get("argv") or ["podium.worker.host"])
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()  # from fresh entropy: siblings would share the helper's state
        torch = sys.modules.get("torch")
        if torch is not None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            # OpenMP read OMP_NUM_THREADS when the helper imported torch, not now.
            torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
        from podium.worker.host import process as host_process

        code = host_process.main(["--ready-fd", str(ready_fd)])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the worker's own crash: its stderr says why
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


def _peer(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def _say(text: str) -> None:
    print(f"fork server {os.getpid()}: {text}", file=sys.stderr, flush=True)


class _Helper:
    """The helper's state: its children, and the one agent it answers (None while orphaned)."""

    def __init__(self, agent: socket.socket, listener: socket.socket | None) -> None:
        self.agent: socket.socket | None = agent
        self.listener = listener
        #: pid -> {"pid", "start", "meta"} (meta: what the agent recorded to adopt it by),
        #: plus "code" once reaped while no agent was there to be told.
        self.children: dict[int, dict] = {}
        #: The monotonic time by which the children must be gone if no agent holds them.
        self.fence_at: float | None = None
        self.stopping = False

    def on_agent(self, selector: selectors.BaseSelector, wake: list[int]) -> bool:
        """Handle one message from the agent; False when the helper should exit. ``wake`` are
        the helper's own descriptors (its wake-up pipe, its selector), which no child keeps."""
        assert self.agent is not None
        try:
            data, fds, _, _ = socket.recv_fds(self.agent, MAX_MESSAGE, 8)
        except InterruptedError:
            return True
        except OSError:
            data, fds = b"", []
        if not data:
            return self._agent_gone(selector)
        request: dict = {}
        try:
            request = json.loads(data)
            if "fence_at" in request:
                self.fence_at = request["fence_at"]
            elif "record" in request:
                child = self.children.get(int(request["record"]))
                if child is not None:
                    child["meta"] = request.get("meta")
            elif request.get("stop"):
                self.stopping = True
            else:
                self._fork(request, fds, wake)
        except Exception as exc:  # noqa: BLE001 - reported to the agent, which falls back
            _send(self.agent, {"id": request.get("id") if isinstance(request, dict) else None,
                               "error": f"{type(exc).__name__}: {exc}"})
        finally:
            for received in fds:
                with contextlib.suppress(OSError):
                    os.close(received)
        return True

    def _fork(self, request: dict, fds: list[int], helper_fds: list[int]) -> None:
        if len(fds) not in (3, 4):
            raise ValueError(f"expected 3 or 4 fds, got {len(fds)}")
        sys.stdout.flush()
        sys.stderr.flush()
        close = list(helper_fds)  # the helper's own descriptors: no child keeps them
        close += [s.fileno() for s in (self.agent, self.listener) if s is not None]
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            _child(request, fds, close, me)
        self.children[pid] = {"pid": pid, "start": start_time(pid), "meta": None}
        _send(self.agent, {"id": request.get("id"), "pid": pid})

    def _agent_gone(self, selector: selectors.BaseSelector) -> bool:
        assert self.agent is not None
        selector.unregister(self.agent)
        self.agent.close()
        self.agent = None
        live = [c for c in self.children.values() if "code" not in c]
        if self.stopping or self.listener is None or not live:
            return False  # exit; the children die with the helper
        wait = (self.fence_at - time.monotonic()) if self.fence_at is not None else 0.0
        _say(f"the agent is gone; keeping {len(live)} worker(s) {max(0.0, wait):.1f} s "
             "(until the node's fence deadline) for a restarted agent to adopt")
        return True

    def on_listener(self, selector: selectors.BaseSelector, loaded: list[str]) -> None:
        """A (restarted) agent connects: hand it every child, or refuse while one is attached."""
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if self.agent is not None or _peer(conn)[1] not in (os.getuid(), 0):
            conn.close()
            return
        self.reap()  # exits already due are handed over with the children, not after them
        self.agent = conn
        selector.register(conn, selectors.EVENT_READ)
        for pid, child in list(self.children.items()):
            _send(conn, {"child": child})
            if "code" in child:
                del self.children[pid]  # its exit is told now
        _send(conn, {"ready": True, "preloaded": loaded, "fence_at": self.fence_at,
                     "adopted": True})
        _say(f"adopted by agent {_peer(conn)[0]} with {len(self.children)} live worker(s)")

    def reap(self) -> None:
        """Reap every ended child: tell the agent, or keep its code for the next one."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            if _send(self.agent, {"exit": pid, "code": code}):
                self.children.pop(pid, None)
            elif pid in self.children:
                self.children[pid]["code"] = code

    def orphan_timeout(self) -> float | None:
        """Seconds left before the fence while no agent is attached (None: an agent is)."""
        if self.agent is not None:
            return None
        return max(0.0, (self.fence_at or 0.0) - time.monotonic())

    def fence(self) -> None:
        """No agent came back in time: kill every child's process group, then reap them."""
        live = [pid for pid, c in self.children.items() if "code" not in c]
        _say(f"no agent adopted the workers by the fence deadline: killing {len(live)} worker(s)")
        for pid in live:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        for pid in live:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _listen(path: str) -> socket.socket:
    """The socket a restarted agent connects to (its folder is the agent's, mode 0700)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a dead helper's: the agent connected to it first and nobody answered
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(4)
    return listener


def serve(fd: int, listen: str | None = None) -> int:
    """The helper's main loop (see the module docstring)."""
    listener = _listen(listen) if listen else None
    bound = os.stat(listen).st_ino if listen else 0
    helper = _Helper(socket.socket(fileno=fd), listener)
    loaded = _preload()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd is written
    selector = selectors.DefaultSelector()
    assert helper.agent is not None
    selector.register(helper.agent, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    if listener is not None:
        selector.register(listener, selectors.EVENT_READ)
    # What the imports made lives as long as every worker: the collector need not scan it
    # again in each child, and not touching it keeps those pages shared after fork.
    gc.collect()
    gc.freeze()
    _send(helper.agent, {"ready": True, "preloaded": loaded})
    _say(f"ready (preloaded {', '.join(loaded)})")
    try:
        while True:
            for key, _ in selector.select(helper.orphan_timeout()):
                if key.fileobj == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(wake_r, 4096):
                            pass
                elif key.fileobj is listener:
                    helper.on_listener(selector, loaded)
                elif key.fileobj is helper.agent:
                    if not helper.on_agent(selector, [wake_r, wake_w, selector.fileno()]):
                        return 0
            helper.reap()
            if helper.orphan_timeout() == 0.0:
                helper.fence()
                return 0
    finally:
        if listener is not None and listen:
            with contextlib.suppress(OSError):
                if os.stat(listen).st_ino == bound:  # not a newer helper's socket
                    os.unlink(listen)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m podium.worker.agent.forkhelper --fd N [--listen PATH]``."""
    parser = argparse.ArgumentParser(prog="python -m podium.worker.agent.forkhelper")
    parser.add_argument("--fd", type=int, required=True, help="the SOCK_SEQPACKET socket to the agent")
    parser.add_argument("--listen", default=None,
                        help="a socket path where a restarted agent re-adopts this helper's workers")
    args = parser.parse_args(argv)
    return serve(args.fd, args.listen)


if __name__ == "__main__":
    sys.exit(main())
