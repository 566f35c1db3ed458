"""A call that has started in the worker host, and what it needs of the stream it came on."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from podium.transport.connection import CallConnection
from podium.v1 import worker_pb2
from podium.worker.host.execthread import Job

__all__ = ["ActiveCall", "CallOrigin"]


class CallOrigin(Protocol):
    """What the host's runtime needs of the call stream a call came on (a ``CallStream``):
    its connection (segments, bulk writes) and a way to answer."""

    @property
    def conn(self) -> CallConnection:
        """The call connection."""

    async def send_outcome(self, call_id: int, outcome: Any) -> None:
        """Answer ``call_id`` with a packaged result."""


class ActiveCall:
    """A call that has started in this worker: its header, gates, job or task, deadline.

    ``gates`` is ``(predecessor's gate, this call's gate)`` on the loop's general path
    (:meth:`~podium.worker.host.admission.CallAdmission.reserve_gate`), None for a call
    admitted to run at once.
    """

    __slots__ = ("answered", "bytes_out", "call_id", "cancelled", "deadline", "gates", "header", "job", "recorded",
                 "started", "stream", "task")

    def __init__(self, call_id: int, header: worker_pb2.CallHeader, stream: Any,
                 gates: tuple[asyncio.Future, asyncio.Future] | None) -> None:
        self.call_id = call_id
        self.header = header
        #: The stream the call came on (a CallStream; the runtime sees it as a CallOrigin).
        self.stream = stream
        self.gates = gates
        self.job: Job | None = None
        self.cancelled = False
        # The deadline counts from the call's admission (see docs/architecture.md).
        self.deadline = time.monotonic() + header.timeout_seconds if header.timeout_seconds > 0 else 0.0
        self.task: asyncio.Task | None = None
        #: monotonic() when a call admitted to run at once started, for the stats.
        self.started = 0.0
        #: monotonic() when the execution thread sent its reply itself (0.0: not so).
        self.answered = 0.0
        #: Bytes of the reply's payload, once known (the timeline's span).
        self.bytes_out = 0
        #: Its span is on the timeline already (recorded by the thread that replied).
        self.recorded = False
