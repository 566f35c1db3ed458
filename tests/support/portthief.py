"""A port thief (issue 51): ``python -m tests.support.portthief HOST`` binds every port of
the kernel's ephemeral range it can on HOST, prints ``bound N`` once, then keeps taking each
port that comes free (every 20 ms) until its stdin closes. What a busy host's outgoing
connections do to a port released in the ephemeral range, made certain."""

from __future__ import annotations

import resource
import socket
import sys
import threading
import time

from podium.worker.agent.ports import ephemeral_range


def main(host: str) -> None:
    low, high = ephemeral_range()
    want = high - low + 64
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:  # root may raise the hard limit too
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    free = list(range(low, high + 1))
    held: list[socket.socket] = []
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    first = True
    while not done.is_set():
        missing = []
        for port in free:
            sock = socket.socket()
            try:
                sock.bind((host, port))
                held.append(sock)
            except OSError:
                sock.close()
                missing.append(port)
        free = missing
        if first:
            print(f"bound {len(held)}", flush=True)
            first = False
        time.sleep(0.02)


if __name__ == "__main__":
    main(sys.argv[1])
