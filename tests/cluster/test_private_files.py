"""Issue #34: every folder and file Podium creates is 0700/0600 in every location, whatever
the umask: ``podium up --dir DIR`` and ``init(log_dir=DIR)`` run here with a umask of 0."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)  # the processes started meanwhile inherit it
    try:
        yield
    finally:
        os.umask(old)


def _loose(root) -> list[str]:
    """Everything under ``root`` (and itself) that others could read: '<mode> <path>'."""
    out = []
    for folder, dirs, files in os.walk(root):
        for path in [folder, *(os.path.join(folder, f) for f in files)]:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode) or stat.S_ISSOCK(st.st_mode):
                continue
            want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
            if stat.S_IMODE(st.st_mode) & ~want:
                out.append(f"{stat.S_IMODE(st.st_mode):o} {path}")
    return out


def _podium(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "podium.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_podium_up_dir_is_private_whatever_the_umask(tmp_path, token):
    root = tmp_path / "local" / "cluster"
    env = dict(os.environ, PODIUM_TOKEN=token, PYTHONUNBUFFERED="1")
    env.pop("PODIUM_ADDRESS", None)
    with _umask(0):
        up = _podium("up", "--dir", str(root), "--nodes", "1", "--gpus-per-node", "1",
                     "--port", "0", "--http-port", "0", env=env)
    try:
        assert up.returncode == 0, up.stderr
        assert (root / "cluster.json").exists() and (root / "logs").is_dir()
        assert _loose(tmp_path / "local") == []
    finally:
        down = _podium("down", "--dir", str(root), env=env)
    assert down.returncode == 0, down.stderr
    assert _loose(tmp_path / "local") == []


SCRIPT = """
import sys
import podium
podium.init(log_dir=sys.argv[1], num_gpus=1)
podium.shutdown()
print("DONE")
"""


def test_init_log_dir_is_private_whatever_the_umask(tmp_path):
    root = tmp_path / "runs" / "one"
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODIUM_")}
    with _umask(0):
        done = subprocess.run([sys.executable, str(script), str(root)], env=env, capture_output=True,
                              text=True, timeout=180)
    assert done.returncode == 0 and "DONE" in done.stdout, done.stderr[-3000:]
    assert sorted(p.name for p in root.iterdir()) != []
    assert _loose(tmp_path / "runs") == []
