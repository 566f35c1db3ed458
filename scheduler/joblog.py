"""A job driver's output: one bounded log file pair that ``logs`` reads and followers tail.

The driver's stdout and stderr reach the scheduler through one pipe; each chunk is
appended to ``driver.log``. When that file passes half of :data:`MAX_LOG_BYTES` it becomes
``driver.log.1`` (replacing the previous one) and a new file starts, so at most
:data:`MAX_LOG_BYTES` are kept per job: its latest output.
"""

from __future__ import annotations

import asyncio
import codecs
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import BinaryIO

from podium.private import open_private

__all__ = ["JobLog", "MAX_LOG_BYTES", "READ_CHUNK"]

#: Log bytes kept per job (its latest output).
MAX_LOG_BYTES = 16 * 1024 * 1024
#: Bytes read from the driver's pipe, or from the file for a follower, at a time.
READ_CHUNK = 64 * 1024


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


class JobLog:
    """The log files of one job in ``folder``, and the wake-up of whoever follows them."""

    def __init__(self, folder: Path, max_bytes: int = MAX_LOG_BYTES) -> None:
        self.path = folder / "driver.log"
        self.old = folder / "driver.log.1"
        self.max_bytes = max_bytes
        self._out: BinaryIO | None = None
        self._size = 0
        self._wake = asyncio.Event()
        #: Followers reading now (each WebSocket of ``logs/tail``).
        self.followers = 0

    def append(self, data: bytes) -> None:
        """Add driver output (rotating at half the bound) and wake the followers."""
        out = self._out
        if out is None:
            out = self._out = open_private(self.path, "ab")
            self._size = out.tell()
        out.write(data)
        out.flush()
        self._size += len(data)
        if self._size > self.max_bytes // 2:
            out.close()
            os.replace(self.path, self.old)
            self._out = open_private(self.path, "ab")
            self._size = 0
        self.poke()

    def poke(self) -> None:
        """Wake every follower (new output, or the job ended)."""
        self._wake.set()
        self._wake = asyncio.Event()

    def close(self) -> None:
        """Close the file (appending again reopens it)."""
        if self._out is not None:
            self._out.close()
            self._out = None
        self.poke()

    def read_all(self) -> bytes:
        """Everything kept, oldest first (blocking file reads: call it off the loop)."""
        parts = []
        for path in (self.old, self.path):
            try:
                parts.append(path.read_bytes())
            except FileNotFoundError:
                pass
        return b"".join(parts)

    def tail(self, nbytes: int) -> bytes:
        """The last ``nbytes`` kept (a failed job's message quotes them)."""
        data = self.read_all()
        return data[-nbytes:]

    async def follow(self, ended: Callable[[], bool], poll: float = 1.0) -> AsyncIterator[str]:
        """Yield the log as text from the start, then what is appended, until ``ended()``
        and everything is read; ``""`` after each ``poll`` seconds without output, so the
        caller can see its own reader leave. A rotation while following is read across: the
        rest of the file that became ``driver.log.1``, then the new one from its start."""
        self.followers += 1
        try:
            async for text in self._follow(ended, poll):
                yield text
        finally:
            self.followers -= 1

    async def _follow(self, ended: Callable[[], bool], poll: float) -> AsyncIterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if self.old.exists():
            for chunk in _chunks(self.old, 0):
                yield decoder.decode(chunk)
        inode, offset = _inode(self.path), 0
        while True:
            finished = ended()  # read before the file: output written before the end is read
            wake = self._wake
            now = _inode(self.path)
            if inode is not None and now != inode and _inode(self.old) == inode:
                for chunk in _chunks(self.old, offset):  # rotated under us: its rest first
                    yield decoder.decode(chunk)
                inode, offset = now, 0
            elif inode is None:
                inode = now
            if inode is not None:
                for chunk in _chunks(self.path, offset):
                    offset += len(chunk)
                    yield decoder.decode(chunk)
            if finished:
                rest = decoder.decode(b"", final=True)
                if rest:
                    yield rest
                return
            try:
                await asyncio.wait_for(wake.wait(), poll)
            except asyncio.TimeoutError:
                yield ""


def _chunks(path: Path, offset: int):
    try:
        with open(path, "rb") as src:
            src.seek(offset)
            while chunk := src.read(READ_CHUNK):
                yield chunk
    except FileNotFoundError:
        return
