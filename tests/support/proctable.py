"""The process table as tests read it (Linux /proc): who is alive, who belongs to whom, and
which addresses listen on a port.

One reader of ``/proc/<pid>/stat`` for every test layer. A zombie counts as dead: it has
exited and only waits for its parent to reap it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, then ppid,
    pgrp, ...), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def live_processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, stat fields) of every process that exists and is not a zombie."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(entry)
            if fields is not None and fields[0] != "Z":
                yield int(entry), fields


def members_of_groups(pgids: set[int]) -> list[int]:
    """Live pids whose process group is one of ``pgids``."""
    return [pid for pid, fields in live_processes() if int(fields[2]) in pgids]


def descendants(roots: set[int]) -> set[int]:
    """Live pids below ``roots`` in the process tree.

    Workers are the agents' descendants (directly, or through a helper such as a fork
    server); compare with a baseline taken when no worker runs."""
    children: dict[int, list[int]] = {}
    for pid, fields in live_processes():
        children.setdefault(int(fields[1]), []).append(pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def listeners(port: int) -> list[str]:
    """The addresses a socket listens on at ``port`` in this network namespace (the IPv4 and
    IPv6 tables of /proc/net)."""
    found = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{name}") as table:
            for line in table.read().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].split(":")
                if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    raw = bytes.fromhex(address)  # 32-bit words, each in host (little-endian) order
                    found.append(socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))
    return found
