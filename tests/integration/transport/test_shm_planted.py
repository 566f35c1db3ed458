"""Shared-memory segment names from a peer against what another process put in /dev/shm
(issue #48): a ``podium-*`` symlink is not followed, a file of another user (uid 65534, via
``setpriv``) is not mapped nor removed, and a weight-broadcast bucket is mapped so that the
replica's writes never reach the sender's segment."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from podium.errors import DataLossError
from podium.rollout.broadcastshm import map_bucket
from podium.transport import shm

SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


def _name() -> str:
    return f"{shm.PREFIX}{os.getpid()}-{uuid.uuid4().hex}"


def test_a_symlink_named_like_a_segment_is_not_followed(tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"keep" * 16)
    name = _name()
    link = os.path.join(shm.SHM_DIR, name)
    os.symlink(target, link)
    try:
        try:
            view = shm.read_segment(name, unlink=False)
        except DataLossError as exc:
            assert "cannot be opened" in str(exc)
        else:  # mapped through the link: a write lands in the target
            view[:4] = b"GONE"
            view.release()
        assert target.read_bytes() == b"keep" * 16
    finally:
        os.unlink(link)


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="needs /usr/bin/python3 for the second user (uid 65534)")
def test_a_segment_file_of_another_user_is_neither_mapped_nor_removed():
    name = _name()
    path = os.path.join(shm.SHM_DIR, name)
    subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, "-c",
                    f"import os; fd = os.open({path!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666); "
                    f"os.write(fd, b'planted' * 10); os.close(fd)"], check=True, timeout=30)
    try:
        assert os.stat(path).st_uid == 65534
        with pytest.raises(DataLossError, match="not a file of this user"):
            shm.read_segment(name)
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def test_a_broadcast_bucket_is_mapped_so_writes_stay_in_the_replica():
    name, size = shm.write_segments([bytes(range(64)) * 4])
    try:
        tensor = map_bucket(name, size, "the test")
        tensor[:8] = 255  # a loader that scribbles on what it was handed
        assert tensor[0].item() == 255
        with open(os.path.join(shm.SHM_DIR, name), "rb") as segment:
            assert segment.read() == bytes(range(64)) * 4
    finally:
        shm.remove_segment(name)
