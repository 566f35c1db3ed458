"""Bad TLS material is a clear error naming the file, at start, on every service."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from podium import errors
from podium.auth import TlsConfig

pytestmark = pytest.mark.faults


def _cases(tls, tmp):
    return [
        ((str(tmp / "missing.pem"), tls.key, tls.ca), "--tls-cert", "No such file"),
        ((tls.ca, tls.key, tls.ca), "--tls-key", "KEY_VALUES_MISMATCH"),  # a cert that is not the key's
        ((tls.cert, tls.key, tls.key), "--tls-ca", "not a PEM CA certificate"),
        ((tls.cert, tls.key, None), "go together", ""),
    ]


def test_from_paths_names_the_bad_file(tls, tmp_path):
    assert TlsConfig.from_paths(None, None, None) is None
    assert TlsConfig.from_paths(tls.cert, tls.key, tls.ca) == tls
    for paths, flag, reason in _cases(tls, tmp_path):
        with pytest.raises(errors.InvalidArgumentError) as info:
            TlsConfig.from_paths(*paths)
        assert flag in str(info.value) and reason in str(info.value)


@pytest.mark.parametrize("role", ["scheduler", "node", "worker"])
def test_services_exit_2_with_one_line(tls, tmp_path, role):
    env = dict(os.environ, PODIUM_TOKEN="t0ken-for-this-test")
    env.pop("PODIUM_TOKEN_FILE", None)
    for paths, flag, reason in _cases(tls, tmp_path)[:3]:
        if role == "worker":  # the agent hands the files over as PODIUM_TLS_*
            argv = [sys.executable, "-m", "podium.worker.host", "--address", "127.0.0.1"]
            env.update(zip(("PODIUM_TLS_CERT", "PODIUM_TLS_KEY", "PODIUM_TLS_CA"), paths))
        else:
            argv = [sys.executable, "-m", "podium.cli", role, "--tls-cert", paths[0], "--tls-key", paths[1],
                    "--tls-ca", paths[2]]
            argv += (["--port", "0", "--http-port", "0", "--state", ":memory:"] if role == "scheduler"
                     else ["--scheduler", "127.0.0.1:1", "--fake-gpus", "1", "--log-dir", str(tmp_path)])
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 2, (role, done.stderr[-2000:])
        assert flag in done.stderr and reason in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        assert "t0ken-for-this-test" not in done.stderr + done.stdout
