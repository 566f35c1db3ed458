"""Ray's Jobs REST API on the scheduler's HTTP port (what ``ray job`` and ``JobSubmissionClient``
of Ray 2.60 call), served by :class:`~podium.scheduler.jobs.JobManager`.

==========================================  ===============================================
path                                        answer (Ray's JSON, and Ray's status codes)
==========================================  ===============================================
GET    /api/version                         ``{"version": "4", "ray_version", ...}``
GET    /api/packages/{protocol}/{name}      200 if the package was uploaded, else 404
PUT    /api/packages/{protocol}/{name}      keep a package (checked; over the bound: 413)
POST   /api/jobs/                           submit: ``{"job_id", "submission_id"}``
GET    /api/jobs/                           every job's ``JobDetails``
GET    /api/jobs/{id}                       one job's ``JobDetails`` (404: unknown id)
GET    /api/jobs/{id}/logs                  ``{"logs": "..."}`` (the latest bytes kept)
GET    /api/jobs/{id}/logs/tail             a WebSocket of text frames until the job ended
POST   /api/jobs/{id}/stop                  ``{"stopped": true}``; false when it had ended
DELETE /api/jobs/{id}                       ``{"deleted": true}`` for an ended job
==========================================  ===============================================

Every one needs the cluster token (the HTTP server's guard, :mod:`podium.scheduler.http`).
Errors are plain text, as Ray's are, with Ray's codes: 400 bad input (a duplicate
submission id included), 404 an unknown job or package. Where Ray answers 500 for what is
the client's mistake, Podium says so: 400 for deleting a live job or a package that is not a
safe zip, 413 for a package or submission over its bound, 429 for too many live jobs, 503
while the scheduler stops.
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import WSCloseCode, web

from podium import errors
from podium.private import open_private
from podium.scheduler.joblog import READ_CHUNK
from podium.scheduler.jobpackages import MAX_PACKAGE_BYTES
from podium.scheduler.jobrecords import parse_submit
from podium.scheduler.jobs import JobManager

__all__ = ["JobsEndpoints", "JobsCollector", "RAY_API_VERSION", "RAY_VERSION", "MAX_SUBMIT_BYTES", "MAX_UPLOADS"]

#: The Jobs API version and the Ray version this server answers to (Ray 2.60's clients check
#: the version is at least 2.8 before sending entrypoint_memory, at least 1.9 for anything).
RAY_API_VERSION = "4"
RAY_VERSION = "2.60.0"
#: Largest job submission body.
MAX_SUBMIT_BYTES = 1024 * 1024
#: Package uploads received at once (each is written to disk as it arrives; others wait,
#: their bodies left unread).
MAX_UPLOADS = 4

_STATUS = ((errors.PayloadTooLargeError, 413), (errors.NotFoundError, 404),
           (errors.InvalidArgumentError, 400), (errors.AlreadyExistsError, 400),
           (errors.FailedPreconditionError, 400), (errors.ResourceExhaustedError, 429),
           (errors.UnavailableError, 503))


def _json(doc) -> web.Response:
    return web.Response(body=orjson.dumps(doc), content_type="application/json")


def _error(exc: errors.PodiumError) -> web.Response:
    status = next((code for kind, code in _STATUS if isinstance(exc, kind)), 500)
    return web.Response(text=str(exc), status=status)


class JobsEndpoints:
    """The routes above over one :class:`JobManager`."""

    def __init__(self, jobs: JobManager, session_name: str) -> None:
        self.jobs = jobs
        self.session_name = session_name
        self._uploads = asyncio.Semaphore(MAX_UPLOADS)

    def install(self, app: web.Application) -> None:
        """Add the routes to ``app``."""
        add = app.router.add_route
        add("GET", "/api/version", self.version)
        add("GET", "/api/packages/{protocol}/{name}", self.package_exists)
        add("PUT", "/api/packages/{protocol}/{name}", self.upload)
        for root in ("/api/jobs/", "/api/jobs"):
            add("POST", root, self.submit)
            add("GET", root, self.list)
        add("GET", "/api/jobs/{id}", self.info)
        add("GET", "/api/jobs/{id}/logs", self.logs)
        add("GET", "/api/jobs/{id}/logs/tail", self.tail)
        add("POST", "/api/jobs/{id}/stop", self.stop)
        add("DELETE", "/api/jobs/{id}", self.delete)

    @staticmethod
    def body_limit(request: web.Request) -> int | None:
        """The body bound of a jobs path (None: not one of them)."""
        path = request.path
        if request.method == "PUT" and path.startswith("/api/packages/"):
            return MAX_PACKAGE_BYTES
        if request.method == "POST" and path in ("/api/jobs/", "/api/jobs"):
            return MAX_SUBMIT_BYTES
        return None

    async def version(self, request: web.Request) -> web.Response:
        """``GET /api/version``."""
        return _json({"version": RAY_API_VERSION, "ray_version": RAY_VERSION,
                      "ray_commit": "podium", "session_name": self.session_name})

    async def package_exists(self, request: web.Request) -> web.Response:
        """``GET /api/packages/{protocol}/{name}``: 200 when it is here, 404 when not."""
        protocol, name = request.match_info["protocol"], request.match_info["name"]
        try:
            found = self.jobs.packages.exists(protocol, name)
        except errors.PodiumError as exc:
            return _error(exc)
        if not found:
            return web.Response(text=f"Package {protocol}://{name} does not exist", status=404)
        return web.Response()

    async def upload(self, request: web.Request) -> web.Response:
        """``PUT /api/packages/{protocol}/{name}``: check and keep the body (a zip), streamed
        to a file (never held whole), :data:`MAX_UPLOADS` at a time."""
        protocol, name = request.match_info["protocol"], request.match_info["name"]
        packages = self.jobs.packages
        try:
            packages.exists(protocol, name)  # the name's check, before any of the body is read
            async with self._uploads:
                staged = packages.staging(name)
                try:
                    received = 0
                    with open_private(staged, "wb") as out:
                        async for chunk in request.content.iter_chunked(READ_CHUNK):
                            received += len(chunk)
                            if received > MAX_PACKAGE_BYTES:  # the middleware checked the length
                                raise errors.PayloadTooLargeError(f"package over {MAX_PACKAGE_BYTES} bytes")
                            out.write(chunk)  # into the page cache: microseconds per chunk
                    await asyncio.to_thread(packages.adopt, protocol, name, staged, self.jobs.packages_in_use())
                finally:
                    staged.unlink(missing_ok=True)
        except errors.PodiumError as exc:
            return _error(exc)
        return web.Response()

    async def submit(self, request: web.Request) -> web.Response:
        """``POST /api/jobs/``."""
        try:
            try:
                doc = orjson.loads(await request.read())
            except orjson.JSONDecodeError as exc:
                raise errors.InvalidArgumentError(f"the request body is not JSON ({exc})") from None
            job = self.jobs.submit(parse_submit(doc))
        except errors.PodiumError as exc:
            return _error(exc)
        return _json({"job_id": job.submission_id, "submission_id": job.submission_id})

    async def list(self, request: web.Request) -> web.Response:
        """``GET /api/jobs/``."""
        return _json([job.details() for job in self.jobs.jobs.values()])

    async def info(self, request: web.Request) -> web.Response:
        """``GET /api/jobs/{id}``."""
        try:
            return _json(self.jobs.get(request.match_info["id"]).details())
        except errors.PodiumError as exc:
            return _error(exc)

    async def logs(self, request: web.Request) -> web.Response:
        """``GET /api/jobs/{id}/logs``."""
        try:
            job = self.jobs.get(request.match_info["id"])
        except errors.PodiumError as exc:
            return _error(exc)
        data = await asyncio.to_thread(self.jobs.log_of(job).read_all)
        return _json({"logs": data.decode(errors="replace")})

    async def tail(self, request: web.Request) -> web.StreamResponse:
        """``GET /api/jobs/{id}/logs/tail``: the log so far, then as it grows, as WebSocket
        text frames; closed normally once the job ended and everything was sent."""
        try:
            job = self.jobs.get(request.match_info["id"])
        except errors.PodiumError as exc:
            return _error(exc)
        ws = web.WebSocketResponse(heartbeat=30.0)
        await ws.prepare(request)
        # The client sends nothing: a receive that returns means it closed or went away, and
        # then following stops (checked at least every second, when follow yields "").
        left = asyncio.ensure_future(ws.receive())
        try:
            async for text in self.jobs.log_of(job).follow(lambda: job.terminal):
                if left.done() or ws.closed:
                    break
                if text:
                    await ws.send_str(text)
        except ConnectionResetError:
            pass
        finally:
            left.cancel()
        if not ws.closed:
            await ws.close(code=WSCloseCode.OK)
        return ws

    async def stop(self, request: web.Request) -> web.Response:
        """``POST /api/jobs/{id}/stop``."""
        try:
            return _json({"stopped": self.jobs.stop(request.match_info["id"])})
        except errors.PodiumError as exc:
            return _error(exc)

    async def delete(self, request: web.Request) -> web.Response:
        """``DELETE /api/jobs/{id}``."""
        try:
            return _json({"deleted": self.jobs.delete(request.match_info["id"])})
        except errors.PodiumError as exc:
            return _error(exc)


class JobsCollector:
    """``podium_scheduler_jobs{status}`` on the scheduler's /metrics: its job records by status
    (counted when scraped)."""

    def __init__(self, jobs: JobManager) -> None:
        self.jobs = jobs

    def collect(self):
        """The one gauge family (prometheus_client's collector protocol)."""
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily("podium_scheduler_jobs", "Submitted jobs by status", labels=["status"])
        counts = dict.fromkeys(("PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED"), 0)
        for job in self.jobs.jobs.values():
            counts[job.status] = counts.get(job.status, 0) + 1
        for status, count in counts.items():
            family.add_metric([status], count)
        yield family
