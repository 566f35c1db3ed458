"""mypy passes over the packages whose types the rest of the system leans on: the root
package ``podium/`` (errors, codec, DataProto, transport, CLI, the Ray compatibility module),
the controller SDK, the pure scheduling core, the worker package's
root modules, its host and its client. Their settings are ``[tool.mypy]`` in pyproject.toml.

The four package folders install under one import root by a ``package-dir`` map that mypy
cannot follow, so the check runs over a tree of symbolic links laid out as the installed
package is (``podium/controller`` -> ``controller/`` and so on).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests.support.waiting import REPO

ROOT = REPO

#: What is checked, as paths inside the installed layout.
CHECKED = [
    "podium/__init__.py", "podium/errors.py", "podium/resources.py", "podium/codec.py", "podium/auth.py",
    "podium/process.py", "podium/rpc.py", "podium/refs.py", "podium/agentlogs.py", "podium/limits.py",
    "podium/private.py", "podium/memcap.py", "podium/cudawire.py", "podium/dataproto", "podium/memorypool.py",
    "podium/rowcat.py", "podium/spans.py",
    "podium/transport", "podium/cli", "podium/compat", "podium/rollout", "podium/controller",
    "podium/scheduler", "podium/worker/agent",
    "podium/worker/colocate.py", "podium/worker/decorator.py", "podium/worker/channel.py",
    "podium/worker/base.py", "podium/worker/actorshell.py", "podium/worker/factory.py",
    "podium/worker/gpufilter.py", "podium/worker/gpus.py", "podium/worker/processenv.py",
    "podium/worker/host", "podium/worker/client.py", "podium/worker/pendingcalls.py",
    "podium/worker/replydecoder.py",
]


def installed_layout(tmp: pathlib.Path) -> pathlib.Path:
    """A tree of links shaped like the installed package."""
    pkg = tmp / "podium"
    pkg.mkdir()
    for entry in (ROOT / "podium").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for folder in ("controller", "worker", "scheduler"):
        (pkg / folder).symlink_to(ROOT / folder)
    return tmp


def test_mypy_passes(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    tree = installed_layout(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(ROOT / ".mypy_cache"), "--no-error-summary", *CHECKED],
        cwd=tree, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]


def test_every_root_module_is_checked():
    # A new module of the root package joins the check in the commit that adds it.
    checked = {pathlib.PurePath(c).name for c in CHECKED if c.startswith("podium/") and c.count("/") == 1}
    modules = {p.name for p in (ROOT / "podium").iterdir()
               if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())) and p.name != "v1"}
    assert modules <= checked, sorted(modules - checked)
