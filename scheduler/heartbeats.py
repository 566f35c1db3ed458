"""The scheduler's open HeartbeatStream calls: serving one, and ending them.

A stream is a wait with no deadline of its own, so the scheduler keeps a table of the open
ones (the call's context -> loop time of its last beat): to end them all when it stops, to
end the ones gone silent, and to excuse them after a stall of its own loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc

from podium import errors
from podium.rpc import MalformedMessage, abort
from podium.v1 import scheduler_pb2

__all__ = ["HeartbeatStreams"]

#: Handles one beat as the unary Heartbeat RPC does (bounded, metered) and answers it.
BeatHandler = Callable[[scheduler_pb2.HeartbeatRequest, Any],
                       Awaitable[scheduler_pb2.HeartbeatResponse]]


class HeartbeatStreams:
    """The open heartbeat streams of one scheduler, with the loop time of each one's last beat."""

    def __init__(self) -> None:
        self._last: dict[grpc.aio.ServicerContext, float] = {}

    def __len__(self) -> int:
        return len(self._last)

    def __iter__(self) -> Iterator[grpc.aio.ServicerContext]:
        return iter(self._last)

    async def serve(self, context: grpc.aio.ServicerContext, handle: BeatHandler) -> None:
        """Answer every beat of one stream in order until its peer ends it; a malformed beat
        ends the stream with its error (as does any error ``handle`` raises)."""
        last, now = self._last, asyncio.get_running_loop().time
        last[context] = now()
        try:
            read, write = context.read, context.write
            while True:
                request = await read()
                if request is grpc.aio.EOF:
                    return
                if isinstance(request, MalformedMessage):  # a peer's garbage bytes
                    await abort(context, request.error)
                last[context] = now()
                await write(await handle(request, context))
        finally:
            last.pop(context, None)

    async def end_all(self, error: errors.PodiumError) -> None:
        """End every open stream now with ``error``."""
        await _end(list(self._last), error)

    async def end_idle(self, idle: float) -> None:
        """End the streams without a beat for ``idle`` seconds (DEADLINE_EXCEEDED)."""
        since = asyncio.get_running_loop().time() - idle
        silent = [context for context, last in self._last.items() if last < since]
        if silent:
            await _end(silent, errors.DeadlineExceededError(
                f"no heartbeat on this stream for {idle:g} s (two node leases)"))

    def excuse(self) -> None:
        """Count every stream's silence from now: the beats the scheduler's loop could not read
        during its own stall do not count against their streams (as with leases)."""
        now = asyncio.get_running_loop().time()
        for context in self._last:
            self._last[context] = now


async def _end(contexts: list, error: errors.PodiumError) -> None:
    await asyncio.gather(*(abort(context, error) for context in contexts),
                         return_exceptions=True)  # abort raises AbortError by design
