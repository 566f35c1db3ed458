"""The node agent's fork server: worker processes without interpreter start-up and imports.

Starting a worker with ``python -m podium.worker.host`` costs an interpreter start plus
the imports of gRPC, Podium and (in every training worker) torch: about a second of CPU
each, paid N times, one after another, on a machine whose cores the new workers share.
So the agent starts ONE helper process at its own start-up,
``python -m podium.worker.agent.forkserver --fd N``, which imports all of that once and then
forks a worker per request:

* The helper is single-threaded and never starts gRPC, an event loop or CUDA; it only
  imports (torch's import starts no CUDA). ``fork()`` from it is therefore safe, and every
  child starts its own gRPC server and event loop from scratch.
* Each child, before running anything else: makes its own session and process group
  (``setsid``, so the agent's ``killpg`` reaches its tree), sets ``PR_SET_PDEATHSIG``
  (SIGKILL when the helper dies; the helper has the same on the agent), puts the request's
  log files on fd 1 and 2 and /dev/null on fd 0, replaces its whole environment with the
  worker environment the agent computed (``CUDA_VISIBLE_DEVICES`` included: nothing has
  touched CUDA yet), changes directory, reseeds numpy's global RNG (siblings would share
  it) and runs ``podium.worker.host.process.main(["--ready-fd", W])``: the same ready-fd contract
  as an exec'd worker, so the agent's readiness and reaping code is unchanged.
* The helper is the workers' parent, so it reaps them (SIGCHLD, ``waitpid``) and reports
  each pid's exit code, Popen style (``-N`` for signal N), to the agent.

Protocol on a ``SOCK_SEQPACKET`` socket pair (one JSON object per message):
agent -> helper ``{"id", "env", "cwd", "argv"}`` with fds (ready pipe write end,
stdout file, stderr file) attached; helper -> agent ``{"ready": true}`` once its imports
are done, ``{"id", "pid"}`` or ``{"id", "error"}`` per request, ``{"exit": pid, "code"}``
per reaped child. If the helper dies, its children die with it and the agent reports them
ended (SIGKILL) and starts workers the exec way from then on.

The agent side is :class:`ForkServer`; :class:`ForkedProcess` stands in for the
``subprocess.Popen`` of a forked worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the helper imports subprocess only when it starts (start())
    import subprocess

__all__ = ["ForkServer", "ForkedProcess", "PRELOAD", "enabled", "main"]

#: Modules the helper imports before it forks anything (missing ones are skipped).
PRELOAD = ("podium.worker.host.process", "podium.worker.base", "podium.dataproto", "uvloop", "numpy",
           "torch", "tensordict",
           # What every worker imported after the fork: the constructor's class resolver and
           # the IDNA codec (Python's socket code encodes host names with it). ~4 ms each,
           # so ~0.5 s of CPU for 128 workers on one node.
           "podium.worker.factory", "encodings.idna")

_PR_SET_PDEATHSIG = 1
_MAX_MESSAGE = 1 << 20

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


# --------------------------------------------------------------------------- helper side


def _send(sock: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):  # the agent is gone: nothing to tell
        sock.send(json.dumps(message).encode())


def _preload() -> list[str]:
    loaded = []
    for name in PRELOAD:
        try:
            __import__(name)
            loaded.append(name)
        except Exception:  # noqa: BLE001 - an optional module missing or broken: workers import it themselves
            pass
    return loaded


def _child(request: dict, fds: list[int], sock: socket.socket, close: list[int], parent: int) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    try:
        os.setsid()
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the helper died in between
            os._exit(1)
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        ready_fd, out_fd, err_fd = fds
        sock.close()
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


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(fd: int) -> int:
    """The helper's main loop (see the module docstring)."""
    sock = socket.socket(fileno=fd)
    loaded = _preload()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd is written
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    me = os.getpid()
    # What the imports made lives as long as every worker: the collector need not scan it
    # again in each child, and not touching it keeps those pages shared after fork.
    gc.collect()
    gc.freeze()
    _send(sock, {"ready": True, "preloaded": loaded})
    print(f"fork server {me} ready (preloaded {', '.join(loaded)})", file=sys.stderr, flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 4096):
                        pass
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 8)
            except InterruptedError:
                continue
            if not data:  # the agent closed its end: stop (children die with us)
                return 0
            request: dict = {}
            try:
                request = json.loads(data)
                if len(fds) != 3:
                    raise ValueError(f"expected 3 fds, got {len(fds)}")
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, fds, sock, [wake_r, wake_w, selector.fileno()], me)
                _send(sock, {"id": request.get("id"), "pid": pid})
            except Exception as exc:  # noqa: BLE001 - reported to the agent, which falls back
                _send(sock, {"id": request.get("id") if isinstance(request, dict) else None,
                             "error": f"{type(exc).__name__}: {exc}"})
            finally:
                for received in fds:
                    with contextlib.suppress(OSError):
                        os.close(received)
        _reap(sock)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m podium.worker.agent.forkserver --fd N``."""
    parser = argparse.ArgumentParser(prog="python -m podium.worker.agent.forkserver")
    parser.add_argument("--fd", type=int, required=True, help="the SOCK_SEQPACKET socket to the agent")
    args = parser.parse_args(argv)
    return serve(args.fd)


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

    def __init__(self, env: dict[str, str], log_path: str | os.PathLike | None = None) -> None:
        self._env = dict(env, PYTHONUNBUFFERED="1")
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready: asyncio.Future | None = None
        self._requests: dict[int, asyncio.Future] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._next_id = 0
        self._send_lock: asyncio.Lock | None = None
        self._room: asyncio.Future | None = None  # set while a request waits for socket room
        self.dead = False

    def start(self) -> None:
        """Start the helper process (it imports in the background)."""
        import subprocess

        from podium.private import open_private
        from podium.process import die_with_parent_argv

        loop = asyncio.get_running_loop()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out = open_private(self._log_path) if self._log_path else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(
                die_with_parent_argv([sys.executable, "-m", "podium.worker.agent.forkserver",
                                      "--fd", str(theirs.fileno())], signal.SIGKILL),
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                env=self._env, start_new_session=True)
        finally:
            theirs.close()
            if not isinstance(out, int):  # a log file, not DEVNULL
                out.close()
        mine.setblocking(False)
        with contextlib.suppress(OSError):
            mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        self._sock = mine
        self._send_lock = asyncio.Lock()
        self._ready = loop.create_future()
        loop.add_reader(mine.fileno(), self._on_readable)

    async def wait_ready(self, timeout: float) -> bool:
        """Whether the helper finished its imports within ``timeout`` seconds."""
        if self.dead or self._ready is None:
            return False
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - not ready: the caller execs instead
            return False
        return not self.dead

    async def spawn(self, env: dict[str, str], cwd: str, fds: tuple[int, int, int],
                    argv: list[str]) -> ForkedProcess:
        """Fork a worker; returns once the helper reported its pid (OSError on failure,
        including no room in the socket or no answer within ``_REQUEST_SECONDS``)."""
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
                data = sock.recv(_MAX_MESSAGE)
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
            if message.get("ready"):
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
        """Stop the helper (its remaining children die with it)."""
        if self._sock is not None and not self.dead:
            self._lost()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            for _ in range(100):
                if proc.poll() is not None:
                    break
                await asyncio.sleep(0.02)
            else:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(5)


if __name__ == "__main__":
    sys.exit(main())
