"""The repository stands alone: its README, docs, code and .proto comments point only to
files inside it (a user who clones it has nothing else)."""

from __future__ import annotations

import ast
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


CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}


def _reads_a_clock(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in CLOCKS
               and isinstance(n.func.value, ast.Name) and n.func.value.id == "time" for n in ast.walk(node))


def elapsed_asserts(source: str) -> list[int]:
    """Lines of ``assert`` statements that compare a difference of clock readings (or a
    name holding one) with something: an assertion on how long something took."""
    tree = ast.parse(source)
    timers = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and _reads_a_clock(n.value)
              for t in n.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for sub in ast.walk(node.test):
            if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Sub) and (
                    _reads_a_clock(sub) or any(isinstance(x, ast.Name) and x.id in timers
                                               for x in (sub.left, sub.right))):
                found.append(node.lineno)
                break
    return found


def test_elapsed_assert_finder_finds_one():
    # The check below passes on an empty answer, so the finder is shown to find one.
    assert elapsed_asserts("import time\nt0 = time.monotonic()\nassert time.monotonic() - t0 < 2\n") == [3]
    assert elapsed_asserts("import time\nd = time.monotonic() + 5\nassert time.monotonic() < d\n") == []


def test_no_test_asserts_a_time():
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in tracked("tests/*.py") for line in elapsed_asserts(p.read_text())]
    assert not bad, "tests assert how long something took:\n" + "\n".join(bad)


def test_every_module_the_docs_name_exists():
    # `podium.x.y` in the README and docs/ names a module, or a name in one, that exists.
    import importlib

    missing = []
    for doc in ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]:
        for name in sorted(set(re.findall(r"`(podium(?:\.\w+)+)`", (ROOT / doc).read_text()))):
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                except ImportError:
                    continue
                for attr in parts[i:]:
                    obj = getattr(obj, attr, None)
                if obj is None:
                    missing.append(f"{doc}: {name}")
                break
    assert not missing, missing


def _product_class_members() -> dict[str, set[str]]:
    """Class name -> the names its body and its methods' ``self.x`` define, over the product."""
    members: dict[str, set[str]] = {}
    for folder in ("podium", "controller", "worker", "scheduler"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef):
                    continue
                names = members.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.Assign):
                        names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
                names |= {a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute)
                          and isinstance(a.value, ast.Name) and a.value.id == "self"}
    return members


def test_every_method_the_docs_name_exists():
    # `Class.method` in the README and docs/ names a member of a product class of that name
    # (or of a facade's, for members made at run time such as Dispatch's and Execute's).
    import importlib

    members = _product_class_members()
    facades = [importlib.import_module(m) for m in ("podium", "podium.controller", "podium.worker")]
    missing = []
    for doc in ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]:
        for cls, attr in sorted(set(re.findall(r"`([A-Z]\w+)\.(\w+)`", (ROOT / doc).read_text()))):
            if cls not in members or attr in members[cls]:
                continue  # not a product class (a wire message, a Ray name), or found
            if not any(hasattr(getattr(f, cls, None), attr) for f in facades):
                missing.append(f"{doc}: {cls}.{attr}")
    assert not missing, missing
