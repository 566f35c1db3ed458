"""Pure parts of the spawner: log tails, exit descriptions, worker env, launch argv, ready lines."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from podium.worker.agent import managed
from podium.worker.agent.exitinfo import HEADER_PREFIX, exit_info, read_tail, stderr_tail
from podium.worker.agent.workerenv import launch_argv, worker_env


def _log(tmp_path, lines, header=True):
    path = tmp_path / "w.err"
    text = (f"{HEADER_PREFIX}grp_0 id=w-1 started now\n" if header else "") + "".join(f"{l}\n" for l in lines)
    path.write_text(text)
    return path


@pytest.mark.parametrize("count, wanted, expected", [
    (3, 50, ["l0", "l1", "l2"]),                       # short file: all, header dropped
    (80, 50, [f"l{i}" for i in range(30, 80)]),         # the last 50
    (80, 0, [f"l{i}" for i in range(80)]),              # 0 means everything
    (0, 50, []),                                        # only the header
])
def test_read_tail(tmp_path, count, wanted, expected):
    path = _log(tmp_path, [f"l{i}" for i in range(count)])
    assert read_tail(path, wanted) == expected


def test_read_tail_handles_missing_files_partial_lines_and_offsets(tmp_path):
    assert read_tail(tmp_path / "absent.err") == []
    path = _log(tmp_path, ["alpha", "beta"], header=False)
    with open(path, "a") as handle:
        handle.write("no newline yet")
    assert read_tail(path, 5) == ["alpha", "beta", "no newline yet"]
    assert read_tail(path, 5, end=len("alpha\n")) == ["alpha"]
    # A bounded read starts mid-line: that partial first line is dropped, not shown cut.
    assert read_tail(path, 5, max_bytes=len("ta\nno newline yet")) == ["no newline yet"]


def test_read_tail_replaces_bad_bytes(tmp_path):
    path = tmp_path / "w.err"
    path.write_bytes(b"ok\n\xff\xfe broken\n")
    assert read_tail(path) == ["ok", "\ufffd\ufffd broken"]


def test_stderr_tail_joins_the_last_lines(tmp_path):
    path = _log(tmp_path, [f"e{i}" for i in range(60)])
    assert stderr_tail(path) == "\n".join(f"e{i}" for i in range(10, 60))


@pytest.mark.parametrize("returncode, requested, reason, expected", [
    (0, False, "", (0, 0, "exited with code 0", False)),
    (3, False, "", (3, 0, "exited with code 3", False)),
    (-9, False, "", (-1, 9, "killed by SIGKILL", False)),
    (-15, False, "", (-1, 15, "killed by SIGTERM", False)),
    (-9, True, "", (-1, 9, "stopped by request", True)),
    (0, True, "", (0, 0, "stopped by request", True)),
    (1, False, "exited before it was ready", (1, 0, "exited before it was ready (exited with code 1)", False)),
    (-200, False, "", (-1, 200, "killed by signal 200", False)),
])
def test_exit_info(tmp_path, returncode, requested, reason, expected):
    path = _log(tmp_path, ["Traceback", "boom"])
    info = exit_info(returncode, path, requested=requested, reason=reason)
    assert (info.exit_code, info.signal, info.reason, info.requested) == expected
    assert info.stderr_tail == "Traceback\nboom"


def test_worker_env_layers_base_scheduler_env_and_defaults():
    base = {"PATH": "/bin", "PODIUM_TOKEN_FILE": "/secret", "RANK": "stale", "PODIUM_TOKEN": "old"}
    given = {"RANK": "3", "WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "2", "PODIUM_WORKER_ID": "w-9"}
    env = worker_env(base, given, token="tok", scheduler="10.0.0.1:50051", worker_id="w-3",
                     node_address="10.0.0.2")
    assert env == {"PATH": "/bin", "RANK": "3", "WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "2",
                   "PODIUM_WORKER_ID": "w-9", "PODIUM_TOKEN": "tok", "PODIUM_SCHEDULER": "10.0.0.1:50051",
                   "PODIUM_NODE_ADDRESS": "10.0.0.2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                   "PYTHONUNBUFFERED": "1"}
    # What the scheduler set wins over the agent's own values.
    mine = worker_env({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"},
                      {"PODIUM_TOKEN": "mine", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, token="tok", scheduler="s")
    assert (mine["PODIUM_TOKEN"], mine["CUDA_DEVICE_ORDER"]) == ("mine", "FASTEST_FIRST")
    # The agent's own device order never leaks in: NVML indices need PCI bus order.
    assert worker_env({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, {}, token="t", scheduler="s")[
        "CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_launch_argv_ends_with_the_contract_command():
    argv = launch_argv((sys.executable, "-m", "podium.worker.host"), 7)
    assert argv[-5:] == [sys.executable, "-m", "podium.worker.host", "--ready-fd", "7"]
    if sys.platform.startswith("linux"):
        # The shim, the agent pid and SIGKILL come first (podium.process).
        assert argv[:4] == [sys.executable, "-I", "-S", "-c"]
        assert argv[5:7] == [str(os.getpid()), str(int(signal.SIGKILL))]


@pytest.mark.parametrize("line, port", [
    (b'{"port": 12345}\n', 12345),
    (b'{"port": 1}', 1),
    (b"", 0),
    (b"\n", 0),
    (b'{"port": 0}\n', 0),
    (b'{"port": 70000}\n', 0),
    (b'{"port": "80"}\n', 0),
    (b"not json\n", 0),
    (b'{"nope": 1}\n', 0),
    (b"[1]\n", 0),
])
def test_parse_ready(line, port):
    got, problem = managed.parse_ready(line)
    assert got == port
    assert bool(problem) == (port == 0)


def test_worker_env_carries_exactly_the_agents_tls_files():
    from podium.auth import TlsConfig

    stale = {"PODIUM_TLS_CERT": "/stale.pem", "PODIUM_TLS_KEY": "/stale.key", "PODIUM_TLS_CA": "/ca0"}
    # Without TLS at the agent, inherited paths do not make the worker serve TLS.
    plain = worker_env(stale, {}, token="t", scheduler="s")
    assert not set(plain) & set(stale)
    tls = TlsConfig(cert="/c.pem", key="/c.key", ca="/ca.pem")
    env = worker_env(stale, {"PODIUM_TLS_CA": "/user"}, token="t", scheduler="s", tls=tls)
    assert (env["PODIUM_TLS_CERT"], env["PODIUM_TLS_KEY"], env["PODIUM_TLS_CA"]) == (
        "/c.pem", "/c.key", "/ca.pem")
