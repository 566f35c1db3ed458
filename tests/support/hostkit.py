"""An in-process worker host with a connected WorkerClient, and the object it hosts (``Echo``).

Shared by the worker-host and transport integration tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time


from podium.worker.caller.client import WorkerClient
from podium.worker.decorator import Dispatch, register
from podium.worker.host.process import start_host


class Echo:
    """A hosted object with one of everything a test needs."""

    def __init__(self, tag: str = "echo") -> None:
        self.tag = tag
        self.ran: list[str] = []
        self.init_thread = threading.get_ident()

    def echo(self, value):
        return value

    def add(self, a, b):
        return a + b

    def thread_id(self):
        return threading.get_ident()

    def record(self, name: str):
        self.ran.append(name)
        return len(self.ran)

    def history(self):
        return list(self.ran)

    def sleep(self, seconds: float, name: str = ""):
        time.sleep(seconds)
        if name:
            self.ran.append(name)
        return name

    def sleep_marked(self, seconds: float, name: str, marker: str):
        """``sleep``, touching ``marker`` first: a test waits for the file, not a guess."""
        open(marker, "w").close()
        return self.sleep(seconds, name)

    def fail(self, message: str):
        raise KeyError(message)

    async def async_add(self, a, b):
        await asyncio.sleep(0)
        return a + b, threading.get_ident()

    async def async_wait(self, seconds: float):
        await asyncio.sleep(seconds)
        return "waited"

    async def async_echo(self, value, delay: float):
        await asyncio.sleep(delay)
        return value

    async def async_fail(self):
        raise RuntimeError("async boom")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def scored(self, data):
        return data

    @register(dispatch_mode={"dispatch_fn": len, "collect_fn": list})
    def custom(self, data):
        return data


@contextlib.asynccontextmanager
async def hosted(token: str, *, env: dict | None = None, construct: bool = True,
                 tcp_only: bool = False):
    """A started host with a started client (constructed with Echo unless told not to)."""
    host = await start_host("127.0.0.1", token=token, env={"RANK": "2", "WORLD_SIZE": "4",
                                                            "PODIUM_WORKER_ID": "w-echo", **(env or {})})
    client = WorkerClient(host.address, token, rank=2)
    try:
        await client.start()
        if tcp_only:
            client.same_host = False
        if construct:
            await client.construct((Echo, (), {"tag": "t"}))
        yield host, client
    finally:
        await client.close()
        await host.stop(grace=0.2)
