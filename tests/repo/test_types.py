"""mypy passes over the whole product: every module of the ``podium`` import root (the root
package and its subpackages, the controller SDK, the scheduler, the worker package with its
node agent and host, the generated ``v1`` stubs). Its settings are ``[tool.mypy]`` in
pyproject.toml.

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

#: What is checked, as paths inside the installed layout: all of it.
CHECKED = ["podium"]


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
