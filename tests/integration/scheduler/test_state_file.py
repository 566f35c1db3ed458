"""Issue #14, items 5 and 7: the state at rest is private, and a damaged state file is
refused with a message naming it and the way out, never loaded as an empty cluster."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys

import pytest

from podium.scheduler.client import SchedulerClient
from podium.scheduler.server import run_scheduler
from podium.scheduler.statefile import StateFileError
from podium.scheduler.store import Store
from podium.v1 import common_pb2
from tests.support.scheduler_fakes import FakeAgent, config

pytestmark = pytest.mark.faults


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def loose_umask():
    old = os.umask(0o022)  # the usual default: files 0644, folders 0755
    try:
        yield
    finally:
        os.umask(old)


def _filled_state(token, arun, path) -> None:
    """A real state file: a node, a detached group, a worker with a secret env (scheduler stopped)."""
    async def scenario():
        running = await run_scheduler(config(token, state=str(path)))
        agent = await FakeAgent(node_id="n1", address="127.0.0.2", token=token,
                                scheduler=running.address).start()
        try:
            async with SchedulerClient(running.address, token) as client:
                await client.register_node(agent.info(gpus=1))
                pg = await client.create_placement_group("keep", [{"GPU": 1}], "PACK", detached=True)
                await client.create_workers([common_pb2.WorkerSpec(
                    name="w", group="g", placement_group_id=pg.id, num_gpus=1, world_size=1,
                    detached=True, env={"HF_TOKEN": "hf_secret"})])
                modes = {suffix: _mode(f"{path}{suffix}") for suffix in ("", "-wal", "-shm", ".lock")}
        finally:
            await agent.stop()
            await running.stop(0)
        return modes
    return arun(scenario())


def test_state_file_wal_and_lock_are_0600_and_new_folders_0700_whatever_the_umask(
        token, arun, tmp_path, loose_umask, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    home = tmp_path / ".podium"
    home.mkdir(mode=0o755)  # as older versions left it
    path = home / "deeper" / "scheduler.db"
    modes = _filled_state(token, arun, path)
    assert modes == {"": 0o600, "-wal": 0o600, "-shm": 0o600, ".lock": 0o600}, modes
    assert _mode(home) == 0o700 and _mode(home / "deeper") == 0o700


def test_an_existing_state_file_of_mode_0644_becomes_0600(token, arun, tmp_path, loose_umask):
    path = tmp_path / "state.db"
    _filled_state(token, arun, path)
    os.chmod(path, 0o644)
    Store(str(path)).close()
    assert _mode(path) == 0o600


def _damage_empty(path):
    path.write_bytes(b"")


def _damage_half(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _damage_garbage(path):
    path.write_bytes(b"this is not a database\n" * 400)


def _damage_foreign(path):
    path.unlink()
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE photos (id INTEGER)")
    db.commit()
    db.close()


def _damage_row(path):
    db = sqlite3.connect(path)
    db.execute("UPDATE workers SET data = x'ffffffff0f'")
    db.commit()
    db.close()


DAMAGE = {"empty": (_damage_empty, "is empty"), "half": (_damage_half, "damaged"),
          "garbage": (_damage_garbage, "not a readable SQLite database"),
          "foreign": (_damage_foreign, "not a Podium state file"),
          "bad-row": (_damage_row, "bad workers row")}


def _checkpointed(token, arun, path):
    """A filled state file with everything in the main file (-wal and -shm gone, as after
    a clean close; the issue's recipe removes them after the kill)."""
    _filled_state(token, arun, path)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(f"{path}{suffix}"):
            os.unlink(f"{path}{suffix}")
    assert path.stat().st_size > 0


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_state_file_is_refused_naming_the_file_and_left_untouched(token, arun, tmp_path, kind):
    path = tmp_path / "state.db"
    _checkpointed(token, arun, path)
    damage, needle = DAMAGE[kind]
    damage(path)
    before = path.read_bytes()
    with pytest.raises(StateFileError) as info:
        Store(str(path))
    message = str(info.value)
    assert needle in message and str(path) in message
    assert "--state" in message and "--fresh-state" in message
    assert path.read_bytes() == before  # nothing lost
    # The lock was released: the refusal can be retried (and is the same).
    with pytest.raises(StateFileError):
        Store(str(path))


def test_fresh_state_moves_the_damaged_file_aside_and_starts_empty(token, arun, tmp_path):
    path = tmp_path / "state.db"
    _checkpointed(token, arun, path)
    _damage_half(path)
    before = path.read_bytes()
    store = Store(str(path), fresh=True)
    try:
        assert store.set_aside.startswith(f"{path}.bad-")
        with open(store.set_aside, "rb") as kept:
            assert kept.read() == before
    finally:
        store.close()
    Store(str(path)).close()  # the new file is a good one


def test_the_scheduler_command_refuses_a_truncated_state_file_without_a_traceback(token, tmp_path):
    path = tmp_path / "state.db"
    path.write_bytes(b"")
    env = dict(os.environ, PODIUM_TOKEN=token)
    done = subprocess.run([sys.executable, "-m", "podium.cli", "scheduler", "--state", str(path),
                           "--port", "0", "--http-port", "0"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert f"state file {path} is empty" in done.stderr and "--fresh-state" in done.stderr
    assert path.stat().st_size == 0


@pytest.mark.parametrize("fresh", [False, True])
def test_the_scheduler_command_refuses_a_directory_as_its_state_file(token, tmp_path, fresh):
    folder = tmp_path / "statedir"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    env = dict(os.environ, PODIUM_TOKEN=token)
    done = subprocess.run([sys.executable, "-m", "podium.cli", "scheduler", "--state", str(folder),
                           "--port", "0", "--http-port", "0", *(["--fresh-state"] if fresh else [])],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "sqlite3" not in done.stderr, done.stderr
    assert f"--state {folder} is a directory" in done.stderr, done.stderr
    # Left as it was: not moved aside, not made 0600, no lock file beside it.
    assert folder.is_dir() and _mode(folder) == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["statedir"]
