"""Where a submitted job's driver runs when it asks for more than the scheduler's machine gives.

A job with ``entrypoint_num_gpus``, ``entrypoint_resources`` (``node:<id or address>``, and
whatever resources bundles accept) or more ``entrypoint_num_cpus`` than the scheduler's
machine has is placed on the cluster like any reservation: one detached placement group
``job:<submission id>`` of one bundle with those resources, so the scheduler accounts its CPUs
and GPUs while the driver runs, and a job that fits no node is refused at once with the
scheduler's reason. Once the group is CREATED, the driver runs on the bundle's node through
its agent (StartDriver, :mod:`podium.worker.agent.drivers`); its log is read from there into
the job's log (ReadDriverLog), and it is stopped there (StopDriver). The group goes when the
job ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any, Callable

import grpc

from podium import errors
from podium.resources import Strategy
from podium.v1 import common_pb2, node_pb2

__all__ = ["JobNodes", "group_name", "wants_node", "bundle_of", "driver_request"]

log = logging.getLogger(__name__)

#: How often a placed job's group is looked at while it waits for capacity.
_WAIT_POLL_SECONDS = 0.2
#: How often a running driver's log is read when the last read brought nothing.
_READ_POLL_SECONDS = 0.25
#: Failed log reads in a row (about a second apart) after which the driver's node is lost.
_READ_FAILURES = 15


def group_name(submission_id: str) -> str:
    """The placement group that holds a placed job's resources."""
    return f"job:{submission_id}"


def wants_node(job: Any, local_cpus: float) -> bool:
    """Whether ``job`` (a JobRecord or SubmitRequest) is placed on the cluster instead of run
    on the scheduler's machine."""
    return bool(job.entrypoint_num_gpus or any((job.entrypoint_resources or {}).values())
                or (job.entrypoint_num_cpus or 0) > local_cpus)


def driver_request(job: Any, packages: Any, env: dict[str, str]) -> node_pb2.StartDriverRequest:
    """The StartDriver of a placed job: its entrypoint, its packages' bytes (from the
    :class:`~podium.scheduler.jobpackages.PackageStore` ``packages``), and the variables of
    ``env`` (the driver's environment here) that are the job's own, not this machine's."""
    spec = job.runtime_env or {}
    uris = [("working_dir", spec.get("working_dir")),
            *[(f"py_modules/{i}", u) for i, u in enumerate(spec.get("py_modules") or [])]]
    zips = [node_pb2.DriverPackage(folder=folder, zip=packages.require(uri).read_bytes())
            for folder, uri in uris if uri]
    own = {k: v for k, v in env.items() if os.environ.get(k) != v and k != "PYTHONPATH"
           and k not in ("PODIUM_TLS_CERT", "PODIUM_TLS_KEY", "PODIUM_TLS_CA")}  # the node's agent sets its own
    return node_pb2.StartDriverRequest(driver_id=job.submission_id, argv=["/bin/sh", "-c", job.entrypoint],
                                       env=own, packages=zips, cwd="working_dir" if spec.get("working_dir") else "",
                                       python_path=[z.folder for z in zips])


def bundle_of(job: Any) -> dict[str, float]:
    """The one bundle a placed job reserves: its CPUs (a little at least: a bundle reserves
    something), GPUs and resources."""
    bundle = {"CPU": float(job.entrypoint_num_cpus or 0) or 0.01}
    if job.entrypoint_num_gpus:
        bundle["GPU"] = float(job.entrypoint_num_gpus)
    bundle.update({k: float(v) for k, v in (job.entrypoint_resources or {}).items() if v})
    return bundle


class JobNodes:
    """Reservations and agents of placed jobs, over the scheduler's service (its model,
    commit and agent links)."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def reserve(self, submission_id: str, bundle: dict[str, float]) -> str:
        """Create the job's group (CREATED or PENDING); InvalidArgumentError naming why when no
        node can ever hold it."""
        service = self.service
        try:
            group = service.model.create_placement_group(group_name(submission_id), [bundle], int(Strategy.PACK),
                                                         True, "", service.clock())
        except errors.InfeasibleError as exc:
            raise errors.InvalidArgumentError(
                f"the entrypoint's resources {bundle} fit no node of the cluster: {exc.message}") from None
        except errors.InvalidSpecError as exc:
            raise errors.InvalidArgumentError(f"entrypoint resources {bundle}: {exc.message}") from None
        self._commit()
        return group.id

    def _commit(self) -> None:
        asyncio.get_running_loop().create_task(self.service._commit())

    async def placed(self, group_id: str) -> common_pb2.BundlePlacement:
        """Wait until the group is CREATED; its bundle's placement. UnavailableError when the
        group was removed meanwhile (a node lost, or the job stopped)."""
        while True:
            try:
                group = self.service.model.group(group_id)
            except errors.NotFoundError:
                raise errors.UnavailableError("the job's reservation was removed") from None
            if group.state == common_pb2.PG_CREATED:
                return group.placements[0]
            if group.state == common_pb2.PG_REMOVED:
                raise errors.UnavailableError(f"the job's reservation was removed: {group.reason or 'removed'}")
            await asyncio.sleep(_WAIT_POLL_SECONDS)

    async def release(self, group_id: str) -> None:
        """Remove the job's group (nothing when it is gone already)."""
        with contextlib.suppress(errors.NotFoundError):
            service = self.service
            _, effects = service.model.remove_placement_group(group_id, service.clock())
            await service._commit()
            await service.agents.stop_workers(effects)

    def abandon(self, job: Any) -> None:
        """A restarted scheduler found ``job`` placed and unfinished: stop what is left of its
        driver on its node (once that node is back) and remove its reservation."""
        if job.node_id:
            asyncio.get_running_loop().create_task(self.stop_driver(job.node_id, job.submission_id, 0, tries=120))
        self.release_name(job.submission_id)

    def release_name(self, submission_id: str) -> None:
        """Remove the group of a job by name, if there is one (at start-up, for jobs a dead
        supervisor left)."""
        with contextlib.suppress(errors.NotFoundError):
            group = self.service.model.group(name=group_name(submission_id))
            asyncio.get_running_loop().create_task(self.release(group.id))

    def agent(self, node_id: str) -> Any:
        """The node agent stub of ``node_id``."""
        return self.service.agents.stub(node_id)

    async def stop_driver(self, node_id: str, submission_id: str, grace: float, *, tries: int = 1) -> None:
        """Stop the driver on its node (or forget it there once it has ended). ``tries`` (about
        a second apart) for a node that may not have registered yet (a restarted scheduler);
        a driver that is not there (its agent died, and it with it) is done."""
        for attempt in range(tries):
            try:
                await self.agent(node_id).StopDriver(
                    node_pb2.StopDriverRequest(driver_id=submission_id, grace_seconds=grace), timeout=grace + 30)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return
            except errors.PodiumError:
                pass  # the node is not known (yet)
            if attempt + 1 < tries:
                await asyncio.sleep(1.0)
        log.warning("job %s: could not stop its driver on node %s", submission_id, node_id)

    async def run(self, job: Any, request: node_pb2.StartDriverRequest, append: Callable[[bytes], None],
                  started: Callable[[int], None]) -> int:
        """Wait for the job's reservation, start its driver on that node, copy its log into
        ``append`` until it ends; its exit code. ``started(pid)`` once it runs.
        UnavailableError when its node stops answering."""
        placement = await self.placed(job.driver_group)
        job.node_id, job.node_address = placement.node_id, placement.node_address
        request.env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, placement.gpu_indices))
        stub = self.agent(placement.node_id)
        reply = await stub.StartDriver(request, timeout=300)
        started(reply.pid)
        offset, failures = 0, 0
        read = node_pb2.ReadDriverLogRequest(driver_id=job.submission_id)
        while True:
            read.offset = offset
            try:
                chunk = await stub.ReadDriverLog(read, timeout=30)
            except grpc.aio.AioRpcError as exc:
                failures += 1
                if failures >= _READ_FAILURES:
                    raise errors.UnavailableError(f"node {placement.node_id} running the driver stopped "
                                                  f"answering: {exc.details()}") from None
                await asyncio.sleep(1.0)
                continue
            failures = 0
            if chunk.data:
                append(chunk.data)
                offset = chunk.next_offset
            elif chunk.ended:
                break
            else:
                await asyncio.sleep(_READ_POLL_SECONDS)
        await self.stop_driver(placement.node_id, job.submission_id, 0)  # forgotten there
        return chunk.exit_code
