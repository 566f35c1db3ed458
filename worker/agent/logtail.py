"""Reading worker log files for ``TailLog``: whole, last lines, or following as they grow."""

from __future__ import annotations

import pathlib
from typing import BinaryIO

from podium.worker.agent.exitinfo import HEADER_PREFIX

__all__ = ["LogFollower", "file_size"]


def file_size(path: pathlib.Path) -> int:
    """Bytes in ``path`` now; 0 when it does not exist yet."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class LogFollower:
    """Complete lines of a growing log file, from a byte offset on, read in bounded chunks.

    The file stays open between reads (a follower polls every few tenths of a second, for
    every worker a controller streams); :meth:`close` when done."""

    CHUNK = 1 << 20

    def __init__(self, stream: str, path: pathlib.Path, offset: int) -> None:
        self.stream = stream
        self._path = path
        self._offset = offset
        self._partial = b""
        self._handle: BinaryIO | None = None

    def close(self) -> None:
        """Close the file (a later drain opens it again)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def drain(self, *, final: bool = False, until: int | None = None):
        """Yield the lines written since the last call (up to byte ``until``); with
        ``final`` also the last line even without its newline."""
        while until is None or self._offset < until:
            limit = self.CHUNK if until is None else min(self.CHUNK, until - self._offset)
            handle = self._handle
            if handle is None:
                try:
                    handle = self._handle = open(self._path, "rb")
                except FileNotFoundError:
                    break
            handle.seek(self._offset)
            data = handle.read(limit)
            if not data:
                break
            self._offset += len(data)
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()
            yield from self._texts(lines)
        if final and self._partial:
            lines, self._partial = [self._partial], b""
            yield from self._texts(lines)

    @staticmethod
    def _texts(lines: list[bytes]):
        for line in lines:
            text = line.decode("utf-8", errors="replace")
            if not text.startswith(HEADER_PREFIX):
                yield text
