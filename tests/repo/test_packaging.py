"""The install ships every package in the tree.

``pyproject.toml`` lists packages by name because four source folders install under one
import root (``package-dir``); a new subpackage left off that list imports in an editable
checkout and is missing from a wheel or the container image. This test walks the folders and
compares.
"""

from __future__ import annotations

import importlib

import pytest

from tests.support.waiting import REPO

try:
    tomllib = importlib.import_module("tomllib")
except ModuleNotFoundError:  # Python 3.10: the backport, where installed
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 reads pyproject.toml with tomli: pip install tomli")


def test_every_package_folder_is_installed():
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    found = set()
    for dotted, folder in setup["package-dir"].items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join((dotted, *rel.parts)) if rel.parts else dotted)
    # A folder mapped on its own (podium.worker -> worker/) is also found under the root
    # mapping only if it sits inside podium/, which none does.
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert listed <= found, f"pyproject.toml lists packages with no folder: {sorted(listed - found)}"
