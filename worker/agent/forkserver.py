"""The node agent's fork server: worker processes without interpreter start-up and imports.

Starting a worker with ``python -m podium.worker.host`` costs an interpreter start plus
the imports of gRPC, Podium and (in every training worker) torch: about a second of CPU
each, paid N times, one after another, on a machine whose cores the new workers share.
So the agent starts ONE helper process at its own start-up,
``python -m podium.worker.agent.forkhelper --fd N`` (:mod:`podium.worker.agent.forkhelper`),
which imports all of that once and then forks a worker per request:

* The helper is single-threaded and never starts gRPC, an event loop or CUDA; it only
  imports (torch's import starts no CUDA). ``fork()`` from it is therefore safe, and every
  child starts its own gRPC server and event loop from scratch.
* Each child, before running anything else: makes its own session and process group
  (``setsid``, so the agent's ``killpg`` reaches its tree), sets ``PR_SET_PDEATHSIG``
  (SIGKILL when the helper dies), puts the request's log files on fd 1 and 2 and /dev/null
  on fd 0, replaces its whole environment with the worker environment the agent computed
  (``CUDA_VISIBLE_DEVICES`` included: nothing has touched CUDA yet), changes directory,
  reseeds numpy's global RNG (siblings would share it) and runs
  ``podium.worker.host.process.main(["--ready-fd", W])``: the same ready-fd contract as an
  exec'd worker, so the agent's readiness and reaping code is unchanged.
* The helper is the workers' parent, so it reaps them (SIGCHLD, ``waitpid``) and reports
  each pid's exit code, Popen style (``-N`` for signal N), to the agent.
* With a ``listen`` path (the agent's log folder), the helper outlives a SIGKILLed agent
  until the node's fence deadline and hands its workers to the next agent that connects
  there: :meth:`ForkServer.start` connects to a living helper before it starts a new one,
  and :attr:`ForkServer.adoptable` lists what it got (see the helper's module).

Protocol on a ``SOCK_SEQPACKET`` socket (one JSON object per message):
agent -> helper ``{"id", "env", "cwd", "argv"}`` with fds (ready pipe write end,
stdout file, stderr file, and a group master's MASTER_PORT socket) attached, ``{"record": pid, "meta"}`` (what to re-adopt a
running worker by), ``{"fence_at": t}`` (after each lease renewal) and ``{"stop": true}``
(an orderly shutdown); helper -> agent ``{"child": {"pid", "start", "meta"[, "code"]}}``
per worker it holds (to an adopting agent only), then ``{"ready": true}`` once its imports
are done, ``{"id", "pid"}`` or ``{"id", "error"}`` per request, ``{"exit": pid, "code"}``
per reaped child. If the helper dies, its children die with it and the agent reports them
ended (SIGKILL) and starts workers the exec way from then on.

The agent side is :class:`ForkServer`; :class:`ForkedProcess` stands in for the
``subprocess.Popen`` of a forked worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import sys
from typing import TYPE_CHECKING, Callable

from podium.worker.agent.forkhelper import MAX_MESSAGE, PRELOAD

if TYPE_CHECKING:  # the agent imports subprocess only when it starts a helper (start())
    import subprocess

__all__ = ["ForkServer", "ForkedProcess", "PRELOAD", "enabled", "LISTEN_NAME"]

log = logging.getLogger(__name__)

#: The socket a helper listens on for a restarted agent, in the agent's log folder.
LISTEN_NAME = "forkserver.sock"
#: Longest Unix socket path the kernel binds (``sun_path`` less its terminating NUL).
_MAX_SOCKET_PATH = 107

#: Send buffer of the agent's end of the socket pair. A group's spawns are requested back
#: to back and each request carries a whole worker environment (a few KiB); with the
#: default buffer the 13th request of a burst got EAGAIN and its worker was exec'd instead
#: (importing torch by itself, several seconds of CPU on 2 cores).
_SEND_BUFFER = 4 << 20

#: Longest a request waits for room in the socket, and for the helper's answer (its pid).
#: The helper forks one request after another, so a deep queue on a loaded machine takes
#: seconds; past this, the agent treats the helper as wedged and execs the worker.
_REQUEST_SECONDS = 60.0


def enabled(env: dict | os._Environ | None = None) -> bool:
    """Whether workers are forked (``PODIUM_FORKSERVER``, default on where Linux allows)."""
    env = os.environ if env is None else env
    return (sys.platform.startswith("linux") and hasattr(socket, "send_fds")
            and env.get("PODIUM_FORKSERVER", "1") != "0")


# --------------------------------------------------------------------------- agent side


class ForkedProcess:
    """What the spawner keeps of a forked worker in place of a ``subprocess.Popen``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        #: Popen-style exit code once the fork server reported it, else None.
        self.returncode: int | None = None
        self._callbacks: list[Callable[[int], None]] = []

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.returncode

    def on_exit(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(returncode)`` once it has ended (at once if it has)."""
        if self.returncode is not None:
            callback(self.returncode)
        else:
            self._callbacks.append(callback)

    def _ended(self, code: int) -> None:
        if self.returncode is not None:
            return
        self.returncode = code
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(code)


def _wake(room: asyncio.Future) -> None:
    """The socket has room: wake the sender waiting on ``room``."""
    if not room.done():
        room.set_result(None)


class ForkServer:
    """The agent's handle on its fork server (all methods on the agent's loop thread)."""

    def __init__(self, env: dict[str, str], log_path: str | os.PathLike | None = None,
                 listen: str | os.PathLike | None = None) -> None:
        self._env = dict(env, PYTHONUNBUFFERED="1")
        self._log_path = log_path
        # Where a helper waits for a restarted agent; None (workers die with the agent) where
        # not given or too long for a Unix socket.
        self._listen = str(listen) if listen and len(str(listen)) <= _MAX_SOCKET_PATH else None
        self._proc: subprocess.Popen[bytes] | None = None
        #: The helper's pid (also when it was adopted rather than started).
        self.pid = 0
        self._sock: socket.socket | None = None
        self._ready: asyncio.Future | None = None
        self._requests: dict[int, asyncio.Future] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._next_id = 0
        self._send_lock: asyncio.Lock | None = None
        self._room: asyncio.Future | None = None  # set while a request waits for socket room
        self.dead = False
        #: The workers a living helper handed over (``{"pid", "start", "meta"[, "code"]}``
        #: each) once :meth:`wait_ready` returned; empty for a helper this agent started.
        self.adoptable: list[dict] = []
        #: The fence deadline (``time.monotonic()``) the previous agent last sent, or None.
        self.inherited_fence_at: float | None = None
        #: Whether :meth:`start` found a living helper of a previous agent.
        self.adopted = False

    def start(self) -> None:
        """Connect to a previous agent's living helper, or start one (it imports in the
        background)."""
        loop = asyncio.get_running_loop()
        mine = self._connect() or self._spawn()
        mine.setblocking(False)
        with contextlib.suppress(OSError):
            mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        self._sock = mine
        self._send_lock = asyncio.Lock()
        self._ready = loop.create_future()
        loop.add_reader(mine.fileno(), self._on_readable)

    def _connect(self) -> socket.socket | None:
        """A socket to a previous agent's helper still holding workers, or None."""
        if self._listen is None or not os.path.exists(self._listen):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(self._listen)
        except OSError:  # nobody listens: a helper that ended (it fenced, or was killed)
            sock.close()
            return None
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
        if uid != os.getuid():  # not a helper of ours: it would get every worker's env, token included
            log.warning("fork server socket %s is served by uid %d, not this agent's: not adopted",
                        self._listen, uid)
            sock.close()
            return None
        self.pid = pid
        self.adopted = True
        return sock

    def _spawn(self) -> socket.socket:
        import subprocess

        from podium.private import open_private
        from podium.process import die_with_parent_argv

        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", "podium.worker.agent.forkhelper", "--fd", str(theirs.fileno())]
        if self._listen is not None:
            # It must outlive a killed agent to hand over the workers (it fences them itself).
            argv += ["--listen", self._listen]
        else:
            argv = die_with_parent_argv(argv, signal.SIGKILL)
        out = open_private(self._log_path) if self._log_path else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=out, env=self._env, start_new_session=True)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
            if not isinstance(out, int):  # a log file, not DEVNULL
                out.close()
        self.pid = self._proc.pid
        return mine

    def adopt(self, pid: int) -> ForkedProcess:
        """The :class:`ForkedProcess` of a handed-over worker (its exits come as for any)."""
        child = self._children[pid] = ForkedProcess(pid)
        return child

    def notify(self, message: dict) -> None:
        """Send the helper a bookkeeping message (``record``, ``fence_at``) without waiting;
        dropped when the socket is full (the next one supersedes it) or the helper is gone."""
        if self.dead or self._sock is None:
            return
        with contextlib.suppress(OSError):
            self._sock.send(json.dumps(message).encode())

    async def wait_ready(self, timeout: float) -> bool:
        """Whether the helper finished its imports within ``timeout`` seconds."""
        if self.dead or self._ready is None:
            return False
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - not ready: the caller execs instead
            return False
        return not self.dead

    async def spawn(self, env: dict[str, str], cwd: str, fds: tuple[int, ...],
                    argv: list[str]) -> ForkedProcess:
        """Fork a worker; returns once the helper reported its pid (OSError on failure,
        including no room in the socket or no answer within ``_REQUEST_SECONDS``). ``fds``:
        the ready pipe's write end, stdout, stderr, and optionally a listening socket the
        worker keeps (its number in ``PODIUM_MASTER_LISTEN_FD``)."""
        if self.dead or self._sock is None:
            raise OSError("the fork server is not running")
        self._next_id += 1
        request_id = self._next_id
        future = asyncio.get_running_loop().create_future()
        self._requests[request_id] = future
        message = json.dumps({"id": request_id, "env": env, "cwd": cwd, "argv": argv}).encode()
        try:
            await self._send(message, list(fds))
            pid = await asyncio.wait_for(future, _REQUEST_SECONDS)
        except asyncio.TimeoutError:
            raise OSError(f"the fork server did not answer within {_REQUEST_SECONDS:.0f} s") from None
        finally:
            self._requests.pop(request_id, None)
        child = ForkedProcess(pid)
        self._children[pid] = child
        if pid in self._early_exits:  # it ended before we knew its pid
            child._ended(self._early_exits.pop(pid))
        return child

    async def _send(self, message: bytes, fds: list[int]) -> None:
        """Send one request, waiting (in turn with other senders) while the socket is full."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _REQUEST_SECONDS
        assert self._send_lock is not None and self._sock is not None
        async with self._send_lock:
            while True:
                if self.dead:
                    raise OSError("the fork server ended")
                try:
                    socket.send_fds(self._sock, [message], fds)
                    return
                except (BlockingIOError, InterruptedError):
                    pass
                self._room = room = loop.create_future()
                fileno = self._sock.fileno()
                loop.add_writer(fileno, _wake, room)
                try:
                    await asyncio.wait_for(room, max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise OSError(f"the fork server took no request for {_REQUEST_SECONDS:.0f} s") from None
                finally:
                    self._room = None
                    if not self.dead:
                        loop.remove_writer(fileno)

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                data = sock.recv(MAX_MESSAGE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._lost()
                return
            try:
                message = json.loads(data)
            except ValueError:
                continue
            if "child" in message:
                self.adoptable.append(message["child"])
            elif message.get("ready"):
                self.inherited_fence_at = message.get("fence_at")
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(True)
            elif "exit" in message:
                child = self._children.pop(message["exit"], None)
                if child is None:
                    self._early_exits[message["exit"]] = int(message["code"])
                else:
                    child._ended(int(message["code"]))
            elif "id" in message:
                future = self._requests.pop(message["id"], None)
                if future is not None and not future.done():
                    if "pid" in message:
                        future.set_result(int(message["pid"]))
                    else:
                        future.set_exception(OSError(f"fork server: {message.get('error')}"))
                elif "pid" in message:
                    # Forked after its request gave up (and the worker was exec'd instead):
                    # nobody manages this one, so it must not live on.
                    with contextlib.suppress(OSError):
                        os.kill(int(message["pid"]), signal.SIGKILL)

    def _lost(self) -> None:
        if self.dead:
            return
        self.dead = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(Exception):
                loop = asyncio.get_running_loop()
                loop.remove_reader(sock.fileno())
                loop.remove_writer(sock.fileno())
        if self._room is not None and not self._room.done():
            self._room.set_result(None)  # the waiting sender sees ``dead`` and gives up
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        error = OSError("the fork server ended")
        for future in self._requests.values():
            if not future.done():
                future.set_exception(error)
        self._requests.clear()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()
        # Its children got SIGKILL from the kernel (PR_SET_PDEATHSIG).
        children, self._children = self._children, {}
        for child in children.values():
            child._ended(-signal.SIGKILL)

    async def close(self) -> None:
        """Stop the helper (its remaining children die with it): ask it, then SIGTERM, then
        SIGKILL, 2 s apart."""
        from podium.process import running

        if self._sock is not None and not self.dead:
            self.notify({"stop": True})  # an orderly end: it must not keep the workers
            self._lost()
        proc = self._proc
        if self.pid <= 0:
            return
        for sig in (0, signal.SIGTERM, signal.SIGKILL):
            if sig:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, sig)
            for _ in range(100):
                # Our child is reaped by poll(); an adopted helper is init's to reap.
                if (proc.poll() is not None) if proc is not None else not running(self.pid):
                    return
                await asyncio.sleep(0.02)
