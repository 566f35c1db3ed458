"""A port thief (issue 51): ``python -m tests.support.portthief ADDR LOW HIGH`` binds every
odd port of LOW-HIGH it can on ADDR, prints ``bound N``, and holds them until its stdin closes.

Linux gives ``bind(port 0)`` odd ports of the ephemeral range and ``connect()`` even ones,
so the host's outgoing connections still find source ports, while every port a
``bind(port 0)`` returns (the agent's old ReservePort) is held on the spare address
127.0.0.99: torch's TCPStore, which binds MASTER_PORT on every address, then gets
EADDRINUSE for certain, as it did by chance on a busy host. :func:`start` covers a range
with as many thieves as the open-file limit needs.
"""

from __future__ import annotations

import pathlib
import socket
import subprocess
import sys

__all__ = ["start", "stop", "THIEF_ADDRESS"]

#: The loopback address the thieves bind on (no node uses it).
THIEF_ADDRESS = "127.0.0.99"
#: Ports one thief takes (under the usual open-file limits).
PER_THIEF = 8000


def start(low: int, high: int, addr: str = THIEF_ADDRESS) -> list[subprocess.Popen]:
    """Thieves over ``low``-``high`` on ``addr``, each holding its ports (stop with :func:`stop`)."""
    procs: list[subprocess.Popen] = []
    try:
        for first in range(low, high + 1, 2 * PER_THIEF):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.support.portthief", addr, str(first),
                 str(min(high, first + 2 * PER_THIEF - 1))],
                cwd=pathlib.Path(__file__).resolve().parents[2], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True))
        for proc in procs:
            line = proc.stdout.readline()
            if not line.startswith("bound "):
                raise RuntimeError(f"a port thief did not start: {line!r}")
    except BaseException:
        stop(procs)
        raise
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    """End the thieves (their stdin closes)."""
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.close()
    for proc in procs:
        proc.wait(timeout=30)


def main(addr: str, low: int, high: int) -> None:
    held = []
    for port in range(low | 1, high + 1, 2):
        sock = socket.socket()
        try:
            sock.bind((addr, port))
            held.append(sock)
        except OSError:
            sock.close()
    print(f"bound {len(held)}", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
