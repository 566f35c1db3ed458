"""podium.transport.shm: a segment written in one process is read in another and vanishes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from podium import codec
from podium.transport import shm
from podium.errors import DataLossError, InvalidArgumentError, PayloadTooLargeError


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(shm.SHM_DIR, name))


def test_write_here_read_in_another_process():
    value = {"t": torch.arange(300_000, dtype=torch.int64), "s": "hello"}
    name, size = shm.write_segments(codec.encode(value).to_segments())
    assert name.startswith(f"podium-{os.getpid()}-") and exists(name)
    script = ("import sys, torch, podium.codec as c, podium.transport.shm as s\n"
              "v = c.decode(s.read_segment(sys.argv[1]))\n"
              "print(int(v['t'].sum()), v['s'], v['t'].dtype)\n")
    result = subprocess.run([sys.executable, "-c", script, name], capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().split() == [str(sum(range(300_000))), "hello", "torch.int64"]
    assert not exists(name)


def test_write_in_another_process_read_here():
    script = ("import torch, podium.codec as c, podium.transport.shm as s\n"
              "name, size = s.write_segments(c.encode(torch.full((1000,), 7.5)).to_segments())\n"
              "print(name, size)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    name, size = result.stdout.decode().split()
    mapped = shm.read_segment(name)
    assert mapped.nbytes == int(size) and not exists(name)
    got = codec.decode(mapped)
    got += 1  # the mapping is writable and private to this reader now
    assert torch.equal(got, torch.full((1000,), 8.5))


def test_read_without_unlink_then_remove():
    name, size = shm.write_segments([b"abc", memoryview(b"defg")])
    assert size == 7
    assert bytes(shm.read_segment(name, unlink=False)) == b"abcdefg" and exists(name)
    assert shm.remove_segment(name) and not exists(name)
    assert not shm.remove_segment(name)


def test_empty_segment():
    name, size = shm.write_segments([])
    assert size == 0 and bytes(shm.read_segment(name)) == b"" and not exists(name)


def test_missing_segment_raises_data_loss():
    name, _ = shm.write_segments([b"x"])
    shm.read_segment(name)
    with pytest.raises(DataLossError):
        shm.read_segment(name)


@pytest.mark.parametrize("name", ["../etc/passwd", "/dev/shm/podium-1-x", "other-1-x", "", "podium-1/x"])
def test_names_that_leave_the_directory_are_refused(name):
    with pytest.raises(InvalidArgumentError):
        shm.read_segment(name)


def test_oversize_segment_is_refused_and_still_unlinked():
    name, _ = shm.write_segments([bytes(100)])
    with pytest.raises(PayloadTooLargeError):
        shm.read_segment(name, max_size=10)
    assert not exists(name)


def test_cleanup_stale_removes_only_dead_creators():
    prefix = f"podium-test{os.getpid()}-"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, timeout=60)
    dead_pid = int(dead.stdout)
    stale = f"{prefix}{dead_pid}-deadbeef"
    live = f"{prefix}{os.getpid()}-cafe"
    for name in (stale, live):
        with open(os.path.join(shm.SHM_DIR, name), "wb") as f:
            f.write(b"x")
    try:
        assert shm.cleanup_stale(prefix) == [stale]
        assert not exists(stale) and exists(live)
    finally:
        for name in (stale, live):
            if exists(name):
                os.unlink(os.path.join(shm.SHM_DIR, name))


def test_domain_is_shared_by_processes_that_see_the_same_shm_dir():
    from podium.v1 import worker_pb2
    from podium.transport.payload import shares_shm

    mine = shm.domain()
    assert mine and mine.count(":") == 2
    other = subprocess.run([sys.executable, "-c", "from podium.transport import shm; print(shm.domain())"],
                           capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert other == mine
    # Same host name but another /dev/shm (a container with a private one) is not shared.
    assert shares_shm(worker_pb2.DescribeResponse(shm_domain=mine))
    assert not shares_shm(worker_pb2.DescribeResponse(shm_domain=mine + "x"))
    assert not shares_shm(worker_pb2.DescribeResponse())
