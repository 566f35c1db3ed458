"""How the controller process fetches refs: the resolver a session installs
(``podium.refs.set_resolver``). It fetches on the session's loop (from any loop it is awaited
on), resolves put values of this process without an RPC, and counts the refs this process
receives as borrows at their owners (:mod:`podium.borrows`). In a worker that opened a session
it keeps the worker host's resolver beside it: a fetch made on the host's loop is the host's.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from podium.controller.session.contract import Session

__all__ = ["Resolver"]


class Resolver:
    """Fetches refs for the controller process (``podium.refs.set_resolver``)."""

    def __init__(self, runtime: "Session", beside: Any = None) -> None:
        self._runtime = runtime
        #: The resolver this one replaced (a worker host's, when a worker's code opened a
        #: session): a fetch awaited on that resolver's loop is its to make.
        self.beside = beside

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The runtime's loop, which owns the fetch clients."""
        return self._runtime.loop

    def owns(self, address: str) -> bool:
        """Whether ``address`` is a store of this process (the session's, or its worker's)."""
        objects = self._runtime.objects
        if objects.store is not None and address == objects.address:
            return True
        return self.beside is not None and self.beside.owns(address)

    async def send_borrows(self, owner: str, borrow: list[str], unborrow: list[str]) -> None:
        """Count borrows of ``owner``'s values, and give borrows back (podium.borrows)."""
        client = await self._runtime.fetch_client(owner)
        await client.channel.release([], borrow=borrow, unborrow=unborrow, borrower=self.borrower)

    @property
    def borrower(self) -> str:
        """This process as a borrower: its worker host's address, which owners watch (a
        driver has none: its end ends the job)."""
        beside = self.beside
        return getattr(beside, "borrower", "") if beside is not None else ""

    async def fetch(self, ref, rows=None):
        from podium.refs import inline_value, lost_error, on_loop
        running = asyncio.get_running_loop()
        if running is not self._runtime.loop:
            beside = self.beside
            if beside is not None and getattr(beside, "loop", None) is running:
                return await beside.fetch(ref, rows)
            return await on_loop(self._runtime.loop, self.fetch(ref, rows))
        if ref.inline is not None:  # a small result that came with its ref: no RPC
            self._runtime.stats["fetches"] += 1
            self._runtime.stats["fetched_bytes"] += len(ref.inline)
            return inline_value(ref, rows)
        objects = self._runtime.objects
        if objects.store is not None and ref.owner_address == objects.address:
            try:  # put() here: no RPC to ourselves
                return objects.local_value(ref, rows)
            except Exception as exc:  # noqa: BLE001 - released: said as ObjectLostError
                raise lost_error(ref, exc) from None
        client = await self._runtime.fetch_client(ref.owner_address)
        try:
            value = await client.fetch(ref, rows)
        except Exception as exc:  # noqa: BLE001 - an owner gone or a released value: ObjectLostError
            raise lost_error(ref, exc) from None
        self._runtime.stats["fetches"] += 1
        self._runtime.stats["fetched_bytes"] += client.last_fetch_bytes
        return value

    def run_sync(self, coro, timeout):
        return self._runtime.run(coro, timeout=timeout, what="fetch")
