"""A stand-in worker process that follows the node agent's bootstrap contract.

Run as ``python agent_fake_worker.py --ready-fd N``. It listens on a TCP port,
writes ``{"port": P}`` to fd N and closes it, like ``podium.worker.host.process``. What
else it does is chosen by environment variables, so tests can script failures:

- ``FAKE_MODE``: ``serve`` (default), ``ignore_term`` (survives SIGTERM),
  ``crash`` (writes to stderr, exits 3 before it is ready), ``no_port`` (closes
  the ready fd without a line and keeps running), ``exit_after_ready`` (exits 0
  once ready).
- ``FAKE_ENV_FILE``: dump the environment there as JSON before becoming ready.
- ``FAKE_CHILD_PID_FILE``: start a long-sleeping child process and write its pid there
  (``{pid}`` in the path becomes this worker's pid).
- ``FAKE_LINES``: print that many numbered lines to stdout and stderr at start.
- ``FAKE_TICK``: once ready, print "tick N" to stdout every that many seconds.

It imports nothing from podium, so it starts in a few tens of milliseconds.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time


def main() -> int:
    fd = int(sys.argv[sys.argv.index("--ready-fd") + 1])
    mode = os.environ.get("FAKE_MODE", "serve")
    if os.environ.get("FAKE_ENV_FILE"):
        with open(os.environ["FAKE_ENV_FILE"], "w") as handle:
            json.dump(dict(os.environ), handle)
    for i in range(int(os.environ.get("FAKE_LINES", "0"))):
        print(f"out line {i}")
        print(f"err line {i}", file=sys.stderr)
    if os.environ.get("FAKE_CHILD_PID_FILE"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["FAKE_CHILD_PID_FILE"].replace("{pid}", str(os.getpid())), "w") as handle:
            handle.write(str(child.pid))
    if mode == "crash":
        print("fatal: the fake worker was told to crash", file=sys.stderr)
        return 3
    if mode == "no_port":
        os.close(fd)
        time.sleep(600)
        return 0
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = socket.socket()
    listener.bind((os.environ.get("PODIUM_NODE_ADDRESS") or "127.0.0.1", 0))
    listener.listen(8)
    os.write(fd, (json.dumps({"port": listener.getsockname()[1]}) + "\n").encode())
    os.close(fd)
    print("ready", flush=True)
    if mode == "exit_after_ready":
        return 0
    tick = float(os.environ.get("FAKE_TICK", "0"))
    count = 0
    while True:
        time.sleep(tick or 1)
        if tick:
            print(f"tick {count}", flush=True)
            count += 1


if __name__ == "__main__":
    sys.exit(main())
