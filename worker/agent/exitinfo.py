"""What a worker's end looks like to the agent: its log tails and its :class:`ExitInfo`."""

from __future__ import annotations

import os
import signal

from podium.v1 import common_pb2

__all__ = ["STDERR_TAIL_LINES", "HEADER_PREFIX", "read_tail", "stderr_tail", "exit_info"]

#: Lines of stderr that travel with an exit report.
STDERR_TAIL_LINES = 50

#: First characters of the header line the agent writes at the top of each log file.
HEADER_PREFIX = "### podium worker "


def read_tail(path: str | os.PathLike, lines: int = STDERR_TAIL_LINES, *,
              end: int | None = None, max_bytes: int = 256 * 1024) -> list[str]:
    """The last ``lines`` lines of a log file (0: all), without the agent's header lines.

    ``end`` stops reading at that byte offset (so a follower can go on from
    exactly there). With ``lines`` set, reads at most ``max_bytes`` before the
    end, so a huge log costs no more than that.
    """
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END) if end is None else end
            start = max(0, size - max_bytes) if lines else 0
            handle.seek(start)
            data = handle.read(size - start)
    except FileNotFoundError:
        return []
    text = data.decode("utf-8", errors="replace")
    out = text.split("\n")
    if start > 0:
        out = out[1:]  # the first piece is a partial line
    if out and out[-1] == "":
        out.pop()
    out = [line for line in out if not line.startswith(HEADER_PREFIX)]
    return out[-lines:] if lines else out


def stderr_tail(path: str | os.PathLike, lines: int = STDERR_TAIL_LINES) -> str:
    """The last lines of a stderr file joined as one string (for ExitInfo.stderr_tail)."""
    return "\n".join(read_tail(path, lines))


def exit_info(returncode: int, stderr_path: str | os.PathLike, *, requested: bool = False,
              reason: str = "") -> common_pb2.ExitInfo:
    """ExitInfo for a process that ended with ``returncode`` (Popen style: -N = signal N)."""
    if returncode < 0:
        sig = -returncode
        try:
            how = f"killed by {signal.Signals(sig).name}"
        except ValueError:
            how = f"killed by signal {sig}"
        code = -1
    else:
        sig, code, how = 0, returncode, f"exited with code {returncode}"
    if requested:
        how = "stopped by request"
    elif reason:
        how = f"{reason} ({how})"
    return common_pb2.ExitInfo(exit_code=code, signal=sig, stderr_tail=stderr_tail(stderr_path),
                               reason=how, requested=requested)
