"""The live dashboard the scheduler serves at ``/``.

One static page (``dashboard.html`` beside this module: HTML, CSS and a little plain
JavaScript, no build step, nothing fetched from elsewhere). The page itself carries
no data, so it is served without the token; it reads the token from the URL fragment
(``http://HOST:8265/#token=...``, never sent to the server) or asks for it, keeps it in
the tab's sessionStorage, and polls ``GET /v1/placement`` with ``Authorization: Bearer``
every 1.5 s: every node and GPU, the bundles and placement groups that own each GPU,
the workers on it with their fraction and real memory.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

__all__ = ["PATHS", "install", "page"]

#: Paths the dashboard serves without the token (the page, not the data).
PATHS = frozenset({"/"})


def page() -> bytes:
    """The dashboard's HTML."""
    return resources.files("podium.scheduler").joinpath("dashboard.html").read_bytes()


def install(app: web.Application) -> None:
    """Add ``GET /`` to the scheduler's aiohttp app."""
    body = page()

    async def index(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store",
                                     # The page only talks to this origin.
                                     "Content-Security-Policy": "default-src 'self'; "
                                     "script-src 'unsafe-inline'; style-src 'unsafe-inline'"})

    app.router.add_get("/", index)
