"""Child processes that die with their parent, started without a fork-unsafe preexec_fn.

Podium starts children from processes that already run gRPC threads (the node
agent starts workers; the controller starts the embedded scheduler and agent).
A ``preexec_fn`` forces a real fork() of such a process, which runs gRPC's fork
handlers and can hang the child before exec; without one, ``subprocess`` uses
vfork(), which runs none. So instead of a preexec_fn the command runs behind a
tiny exec shim (``python -I -S -c ...``, ~20 ms) that sets
``prctl(PR_SET_PDEATHSIG, sig)``, checks the parent is still alive, and
``execvp``s the real command in the same process (same pid; the death signal
survives exec).

The kernel sends the signal when the *thread* that started the child ends, so
start children from a thread that lives as long as the parent (the main thread
or the event-loop thread). Grandchildren are not covered.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import sys
from typing import Sequence

#: argv: parent pid, signal number, command...
_SHIM = "\n".join([
    "import ctypes, os, sys",
    "ctypes.CDLL(None).prctl(1, int(sys.argv[2]), 0, 0, 0)",  # PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]): os._exit(1)",  # the parent died already
    "try: os.execvp(sys.argv[3], sys.argv[3:])",
    "except OSError as e: sys.stderr.write(f'podium: cannot start {sys.argv[3]!r}: {e}\\n'); os._exit(127)",
])

#: The shim needs Linux's prctl; elsewhere commands run as they are.
SUPPORTED = sys.platform.startswith("linux")


def die_with_parent_argv(argv: Sequence[str], sig: int = signal.SIGKILL) -> list[str]:
    """``argv`` wrapped so the process gets ``sig`` when this process (thread) dies."""
    if not SUPPORTED:
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _SHIM, str(os.getpid()), str(int(sig)), *argv]


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22),
    or None when there is no such process. A pid and its start time name one process: a pid
    the kernel reused belongs to a process that started later."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    try:
        return int(fields[19])  # field 22 overall; fields[0] is field 3 (the state)
    except (IndexError, ValueError):
        return None


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie, ended but not yet reaped by
    its parent, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


#: /proc/PID/stat state letters in words (proc(5)).
STATE_NAMES = {"R": "running", "S": "sleeping", "D": "disk sleep", "T": "stopped",
               "t": "tracing stop", "Z": "zombie", "X": "dead", "I": "idle", "P": "parked",
               "W": "waking", "K": "wakekill"}


def kernel_state(pid: int) -> tuple[str, str, str, int]:
    """(state letter, its name, wchan, threads) of process ``pid`` from ``/proc``; the letter
    is "" and the name "not running" when there is no such process. wchan is "" where the
    kernel does not show it (it hides it from other users, or reports "0")."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        letter, threads = fields[0].decode(), int(fields[17])  # fields 3 and 20 overall
    except (OSError, IndexError, ValueError):
        return "", "not running", "", 0
    wchan = ""
    try:
        with open(f"/proc/{pid}/wchan", "rb") as f:
            text = f.read(256).decode(errors="replace").strip()
        wchan = "" if text in ("0", "") else text
    except OSError:
        pass
    return letter, STATE_NAMES.get(letter, "unknown"), wchan, threads


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit, logging the change;
    returns (old, new) soft limits.

    Each connection costs a descriptor, and the soft limit (often 1024) is far below what a
    server with hundreds of peers, and the connections an attacker may hold until they are
    evicted, can need; the hard limit is what the administrator allows. Every Podium process
    calls this at start (scheduler, node agent, worker host, controller).
    """
    log = logging.getLogger("podium.process")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        log.info("RLIMIT_NOFILE: soft limit %d, already the hard limit", soft)
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:  # e.g. a hard limit above the kernel's nr_open
        log.warning("RLIMIT_NOFILE: cannot raise the soft limit from %d to %d: %s", soft, target, exc)
        return soft, soft
    log.info("RLIMIT_NOFILE: raised the soft limit from %d to the hard limit %d", soft, target)
    return soft, target
