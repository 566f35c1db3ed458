"""The scheduler's ``Packages`` service: uploaded job packages read by the node agents whose
workers' runtime_env names one (``working_dir``/``py_modules`` as ``gcs://_ray_pkg_<hash>.zip``).

The packages are the jobs' :class:`~podium.scheduler.jobpackages.PackageStore`, checked whole
when uploaded; reading one marks it used, so the store keeps it longer. The server's token
interceptor guards it as every other RPC.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc

from podium.errors import UnavailableError
from podium.rpc import handle_errors
from podium.scheduler.jobpackages import MAX_PACKAGE_BYTES, PackageStore
from podium.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["PackagesService", "CHUNK_BYTES", "add_to_server"]

#: Bytes per streamed message (well under gRPC's message bound).
CHUNK_BYTES = 1 << 20


class PackagesService(scheduler_pb2_grpc.PackagesServicer):
    """Streams stored packages to node agents."""

    def __init__(self, store: PackageStore | None = None) -> None:
        #: The jobs' store; None until the scheduler made it (reads are UNAVAILABLE until then).
        self.store = store

    @handle_errors
    async def ReadPackage(self, request: scheduler_pb2.ReadPackageRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.PackageChunk]:
        """The package's bytes in :data:`CHUNK_BYTES` chunks (NotFoundError when not stored)."""
        if self.store is None:
            raise UnavailableError("the scheduler is starting: its package store is not open yet")
        path = await asyncio.to_thread(self.store.require, request.uri)  # checks the name too
        handle = open(path, "rb")  # noqa: SIM115 - closed below, across the stream
        try:
            size = min(path.stat().st_size, MAX_PACKAGE_BYTES)
            sent = 0
            while sent < size:
                data = await asyncio.to_thread(handle.read, min(CHUNK_BYTES, size - sent))
                if not data:
                    break
                sent += len(data)
                yield scheduler_pb2.PackageChunk(data=data, size=size)
        finally:
            handle.close()


def add_to_server(server: grpc.aio.Server, store: PackageStore | None = None) -> PackagesService:
    """Serve ``store``'s packages on ``server`` (set ``.store`` later when it is made after
    the server starts)."""
    service = PackagesService(store)
    scheduler_pb2_grpc.add_PackagesServicer_to_server(service, server)
    return service
