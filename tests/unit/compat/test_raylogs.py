"""Ray's log monitor loop over a folder (podium.compat.raylogs), without a cluster: what it
publishes, under which names, and the bounds on its arguments."""

from __future__ import annotations

import io
import os

import pytest

from podium.compat import raylogs
from podium.errors import InvalidArgumentError, PermissionDeniedError


class Keep:
    def __init__(self):
        self.batches = []

    def publish_logs(self, data):
        self.batches.append(data)


def test_new_lines_are_published_once_under_the_name_podiums_header_gives(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    out = logs / f"worker-w1-00ab-{os.getpid()}.out"
    out.write_text("### podium worker actor:ns:trainer-0 id=w1 node=n started now\nfirst\n:task_name:step\nsecond\n")
    keep = Keep()
    monitor = raylogs.LogMonitor(node_ip_address="127.0.0.1", logs_dir=str(logs), gcs_client=keep)
    monitor._labels[str(out)] = raylogs.actor_label("actor:ns:trainer-0")
    monitor.update_log_filenames()
    monitor.open_closed_files()
    assert monitor.check_log_files_and_publish_updates()
    assert [(b["actor_name"], b["task_name"], b["lines"], b["pid"], b["is_err"]) for b in keep.batches] == [
        ("trainer-0", None, ["first"], os.getpid(), False), ("trainer-0", "step", ["second"], os.getpid(), False)]
    with open(out, "a") as f:
        f.write("third\n")
    monitor.open_closed_files()
    monitor.check_log_files_and_publish_updates()
    assert keep.batches[-1]["lines"] == ["third"] and len(keep.batches) == 3
    assert not monitor.check_log_files_and_publish_updates()  # nothing new, nothing again


def test_labels_stand_for_rays_actor_name_line():
    assert raylogs.actor_label("actor:roll:actor_train-0") == "actor_train-0"
    assert raylogs.actor_label("actor:Talker-0a1b2c3d4e5f") == "Talker"
    assert raylogs.actor_label("wg-rank-3") == "wg-rank-3"


def test_batches_print_as_rays_driver_prints_them():
    sink = io.StringIO()
    raylogs.print_worker_logs({"ip": "10.0.0.2", "pid": 42, "actor_name": "critic", "lines": ["a", "b"]}, sink)
    assert sink.getvalue() == "(critic pid=42, ip=10.0.0.2) a\n(critic pid=42, ip=10.0.0.2) b\n"


def test_the_session_folder_is_under_podium_ray_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PODIUM_RAY_DIR", str(tmp_path))
    socket_name = raylogs.object_store_socket_name()
    assert os.path.join(os.path.dirname(os.path.dirname(socket_name)), "logs") == raylogs.session_logs_dir()
    assert raylogs.session_logs_dir() == str(tmp_path / "session_latest" / "logs")


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="publish_logs"):
        raylogs.LogMonitor(node_ip_address="127.0.0.1", logs_dir=str(tmp_path), gcs_client=object())
    with pytest.raises(InvalidArgumentError, match="max_files_open"):
        raylogs.LogMonitor(node_ip_address="127.0.0.1", logs_dir=str(tmp_path), gcs_client=Keep(), max_files_open=0)
    assert raylogs.is_proc_alive(os.getpid())


def test_a_logs_dir_others_can_write_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("PODIUM_SINGLE_USER", raising=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # another user could plant links to files of ours there
    with pytest.raises(PermissionDeniedError, match="logs_dir"):
        raylogs.LogMonitor(node_ip_address="127.0.0.1", logs_dir=str(shared), gcs_client=Keep())
    assert not (shared / "old").exists()
