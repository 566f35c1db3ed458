"""Issue #48: a folder the user gives Podium (``init(log_dir=)``, ``podium node --log-dir``,
``podium up --dir``) is refused when another local user could plant something in it; the
agent adopts no fork server of another uid; a port file is read only when the child Podium
started wrote it; nothing is written through a symlink. The other user is uid 65534
(``setpriv``), with the system Python: the test's own interpreter is not reachable to it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest

from tests.support.seconduser import NOBODY, SECOND_USER, SYSTEM_PYTHON

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]



def _env(token: str) -> dict:
    env = dict(os.environ, PODIUM_TOKEN=token, PYTHONUNBUFFERED="1")
    env.pop("PODIUM_ADDRESS", None)
    return env


def _run(argv: list[str], env: dict, timeout: float = 60) -> tuple[int, str]:
    """Exit code and output; a command still running at ``timeout`` counts as code -1."""
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return -1, f"still running after {timeout:g} s: {exc.stdout} {exc.stderr}"
    return done.returncode, done.stdout + done.stderr


def _init(log_dir, token: str) -> tuple[int, str]:
    code = textwrap.dedent(f"""
        import podium
        podium.init(log_dir={str(log_dir)!r}, num_cpus=2, num_gpus=0)
        print("INIT OK")
        podium.shutdown()
    """)
    return _run([sys.executable, "-c", code], _env(token), timeout=120)


@pytest.fixture
def shared_tmp():
    """A folder under /tmp that uid 65534 can enter (pytest's tmp_path is root's, 0700)."""
    root = tempfile.mkdtemp(prefix="podium-given-")
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@SECOND_USER
def test_a_folder_others_can_write_is_refused_by_every_entry_point(shared_tmp, token):
    open_to_all = os.path.join(shared_tmp, "open")
    os.mkdir(open_to_all)
    os.chmod(open_to_all, 0o777)
    theirs = os.path.join(shared_tmp, "theirs")
    os.mkdir(theirs, 0o700)
    os.chown(theirs, 65534, 65534)
    under_open = os.path.join(open_to_all, "mine")  # ours, 0700, but the folder above is everyone's
    os.mkdir(under_open, 0o700)
    for folder, fix in ((open_to_all, "chmod go-w"), (theirs, "mkdir -m 700"), (under_open, "only you can write")):
        code, out = _init(folder, token)
        assert code != 0 and "INIT OK" not in out and folder in out and fix in out, out[-3000:]
        code, out = _run([sys.executable, "-m", "podium.cli", "node", "--scheduler", "127.0.0.1:9",
                          "--host", "127.0.0.1", "--log-dir", folder], _env(token), timeout=30)
        assert code > 0 and folder in out and fix in out, out[-3000:]
        code, out = _run([sys.executable, "-m", "podium.cli", "up", "--dir", folder, "--nodes", "1",
                          "--gpus-per-node", "0", "--port", "0", "--http-port", "0"], _env(token))
        assert code > 0 and folder in out and fix in out, out[-3000:]
    assert os.listdir(theirs) == []  # nothing was written there


@SECOND_USER
def test_the_agent_adopts_no_fork_server_of_another_user(shared_tmp):
    from podium.worker.agent.forkserver import LISTEN_NAME, ForkServer

    folder = os.path.join(shared_tmp, "open")
    os.mkdir(folder)
    os.chmod(folder, 0o777)
    path = os.path.join(folder, LISTEN_NAME)
    planted = subprocess.Popen(NOBODY + [SYSTEM_PYTHON, "-c", textwrap.dedent(f"""
        import socket, sys
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind({path!r}); s.listen(4)
        print("ready", flush=True)
        conn, _ = s.accept()
        print("connected", flush=True)
        conn.settimeout(5)
        try:
            print("got", len(conn.recv(1 << 20)), flush=True)
        except OSError:
            print("got nothing", flush=True)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert planted.stdout.readline().strip() == "ready"
        server = ForkServer({"PODIUM_TOKEN": "secret"}, None, listen=path)
        sock = server._connect()
        assert sock is None and not server.adopted
    finally:
        planted.kill()
        planted.wait(10)


def test_a_port_file_the_child_did_not_write_is_not_read(tmp_path, token):
    root = tmp_path / "logs"
    root.mkdir(mode=0o700)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(8)
    port = squatter.getsockname()[1]
    # An earlier run's file in a reused log_dir, or one planted: not this run's scheduler.
    (root / "scheduler.port.json").write_text(json.dumps({"port": port, "http_port": port, "pid": 1}))
    try:
        code, out = _init(root, token)
        assert code == 0 and "INIT OK" in out, out[-3000:]
        squatter.setblocking(False)
        with pytest.raises(BlockingIOError):  # nobody dialled the old port, with the token or not
            squatter.accept()
    finally:
        squatter.close()


def test_nothing_is_written_through_a_symlink(tmp_path, token):
    root = tmp_path / "logs"
    root.mkdir(mode=0o700)
    target = tmp_path / "precious"
    target.write_text("keep\n")
    os.chmod(target, 0o644)
    (root / "scheduler.log").symlink_to(target)
    code, out = _init(root, token)
    assert code != 0 and "symbolic link" in out, out[-3000:]
    assert target.read_text() == "keep\n" and oct(target.stat().st_mode & 0o777) == oct(0o644)
