"""private.given_dir (issue #48): a folder the user gives Podium is refused when another user
could plant files in it, naming the folder and the fix; ``PODIUM_SINGLE_USER=1`` lifts the
check for single-uid containers. (Ownership by another uid: tests/cluster/test_given_folders.py.)"""

from __future__ import annotations

import os
import stat

import pytest

from podium.errors import PermissionDeniedError
from podium.private import given_dir


def test_a_private_folder_is_taken_and_a_missing_one_made_0700(tmp_path):
    assert given_dir(tmp_path, "--x") == tmp_path.resolve()
    made = given_dir(tmp_path / "a" / "b", "--x")
    assert made.is_dir() and stat.S_IMODE(made.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o757])
def test_a_folder_others_can_write_is_refused_with_the_fix(tmp_path, mode, monkeypatch):
    monkeypatch.delenv("PODIUM_SINGLE_USER", raising=False)
    folder = tmp_path / "open"
    folder.mkdir()
    os.chmod(folder, mode)
    with pytest.raises(PermissionDeniedError, match="chmod go-w") as caught:
        given_dir(folder, "--log-dir")
    assert str(folder) in str(caught.value) and "--log-dir" in str(caught.value)
    below = folder / "mine"
    with pytest.raises(PermissionDeniedError, match="the folder above it"):
        given_dir(below, "--log-dir")
    assert not below.exists()  # nothing made under an unsafe folder


def test_a_sticky_folder_above_is_fine_but_not_as_the_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("PODIUM_SINGLE_USER", raising=False)
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    assert given_dir(sticky / "mine", "--x").is_dir()
    with pytest.raises(PermissionDeniedError):
        given_dir(sticky, "--x")


def test_single_user_containers_lift_the_check(tmp_path, monkeypatch):
    folder = tmp_path / "emptydir"
    folder.mkdir()
    os.chmod(folder, 0o777)
    monkeypatch.setenv("PODIUM_SINGLE_USER", "1")
    assert given_dir(folder, "--log-dir") == folder.resolve()


def test_private_file_and_open_private_never_go_through_a_symlink(tmp_path):
    from podium.private import open_private, private_file

    target = tmp_path / "precious"
    target.write_text("keep\n")
    os.chmod(target, 0o644)
    link = tmp_path / "state.db-wal"
    link.symlink_to(target)
    private_file(link)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    with pytest.raises(PermissionDeniedError, match="symbolic link"):
        open_private(link)
    assert target.read_text() == "keep\n"
    mine = tmp_path / "mine"
    mine.write_text("x")
    os.chmod(mine, 0o644)
    private_file(mine)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o600
