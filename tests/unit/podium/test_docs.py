"""The repository stands alone: its README, docs, code and .proto comments point only to
files inside it (a user who clones it has nothing else)."""

from __future__ import annotations

import pathlib
import re
import subprocess

from tests.support.waiting import REPO

ROOT = REPO
OUTSIDE = re.compile(r"\.\./shared|/work/shared|DESIGN\.md|VERL_REFERENCE\.md")


def tracked(*patterns: str) -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True,
                         timeout=30, check=True).stdout.split()
    return [ROOT / name for name in out if not name.startswith("bench/results/")]


def test_nothing_points_outside_the_repository():
    files = tracked("*.py", "*.md", "*.proto", "*.pyi", "*.toml", "*.yml", "*.yaml", "*.sh", ".ci/run")
    assert files
    bad = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
           for p in files if p != pathlib.Path(__file__)
           for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert not bad, "\n".join(bad)


def test_every_docs_link_names_a_file_that_exists():
    texts = [p.read_text() for p in tracked("*.md", "*.py", "*.proto")]
    named = {m for text in texts for m in re.findall(r"\bdocs/[\w./-]+\.md\b", text)}
    assert "docs/architecture.md" in named
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, missing
