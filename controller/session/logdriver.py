"""Worker output at the controller (Ray's ``log_to_driver``).

For every worker a WorkerGroup starts, the runtime opens one ``NodeAgent.TailLog``
stream (follow, from the top of the file) on the worker's node and writes each line
to the controller's own stdout or stderr (the stream the worker used), prefixed with
role, rank and node::

    (ScoreWorker rank=1, node=127.0.0.2) hello

Podium's own INFO/DEBUG log lines from the worker host (``... rank1 INFO podium.worker.host:
serving on ...``) are left out; warnings and errors, and everything user code prints,
come through. Off with ``init(log_to_driver=False)`` or ``PODIUM_LOG_TO_DRIVER=0``.

The streams run on the runtime's event loop; a stream ends by itself when its worker
exits (after the agent has sent the last lines), and :meth:`LogToDriver.close` cancels
what is left when the runtime shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import sys
from typing import Any, Iterable, TextIO

__all__ = ["LogToDriver", "log_to_driver_enabled", "is_internal_line"]

log = logging.getLogger("podium.controller")

# The worker host's logging format: "<date> <time> rank<R> LEVEL logger: message".
_INTERNAL = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ rank\S* (?:INFO|DEBUG) podium[\w.]*: ")


def log_to_driver_enabled(value: bool | None = None) -> bool:
    """The setting: ``value`` if given, else ``PODIUM_LOG_TO_DRIVER`` (default on)."""
    if value is not None:
        return bool(value)
    return os.environ.get("PODIUM_LOG_TO_DRIVER", "1").strip().lower() not in ("0", "false", "no", "off", "")


def is_internal_line(text: str) -> bool:
    """True for Podium's own INFO/DEBUG lines in a worker's log (not forwarded)."""
    return bool(_INTERNAL.match(text))


class LogToDriver:
    """One TailLog(follow) stream per worker, printed with a role/rank prefix."""

    def __init__(self, token: str, tls: Any = None, *, stdout: TextIO | None = None,
                 stderr: TextIO | None = None) -> None:
        self._token = token
        self._tls = tls
        self._stdout = stdout
        self._stderr = stderr
        self._tasks: dict[str, asyncio.Task] = {}
        #: Lines forwarded so far (tests, and a hint that streams work).
        self.lines = 0

    def _out(self, stream: str) -> TextIO:
        if stream == "stderr":
            return self._stderr or sys.stderr
        return self._stdout or sys.stdout

    async def watch(self, scheduler: Any, infos: Iterable[Any], role: str) -> None:
        """Start streaming the logs of these workers (WorkerInfo) of class ``role``."""
        from podium.agentlogs import agent_address

        infos = [i for i in infos if i.id not in self._tasks]
        if not infos:
            return
        state = await scheduler.cluster_state()
        loop = asyncio.get_running_loop()
        for info in infos:
            try:
                address = agent_address(state, info.node_id)
            except Exception as exc:  # noqa: BLE001 - logs are best effort
                log.debug("no log stream for worker %s: %s", info.id, exc)
                continue
            prefix = f"({role} rank={info.spec.rank}, node={info.node_address}) "
            task = loop.create_task(self._stream(address, info.id, prefix),
                                    name=f"podium-log-{info.id}")
            self._tasks[info.id] = task
            task.add_done_callback(functools.partial(self._forget, info.id))

    def _forget(self, worker_id: str, _task: asyncio.Task) -> None:
        self._tasks.pop(worker_id, None)

    async def _stream(self, address: str, worker_id: str, prefix: str) -> None:
        from podium.agentlogs import tail_log

        try:
            async for line in tail_log(address, self._token, worker_id, follow=True, tls=self._tls):
                if is_internal_line(line.text):
                    continue
                out = self._out(line.stream)
                # One write per line, so lines of different workers never interleave.
                out.write(prefix + line.text + "\n")
                out.flush()
                self.lines += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - an agent gone or a worker forgotten ends the stream
            log.debug("log stream of worker %s ended: %s", worker_id, exc)

    async def close(self, grace: float = 1.0) -> None:
        """Let the streams drain for up to ``grace`` seconds, then cancel the rest."""
        tasks = list(self._tasks.values())
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=grace)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(BaseException):
                await task
