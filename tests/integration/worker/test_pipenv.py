"""runtime_env ``pip`` on a node (podium.worker.agent.pipenv), with real venvs and pip and a
wheel built here (no package index): one virtualenv per set, made once when several workers
ask at once, inheriting the base environment; a failed install leaves nothing a later worker
would reuse; the cache keeps at most its bound, never removing a set in use."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from podium.runtimeenv import SETUP_FAILED_EXIT
from podium.worker.agent import envlauncher, pipenv
from tests.support.wheels import tiny_wheel

pytestmark = pytest.mark.timeout(300)


def _set(*packages: str) -> dict:
    return {"installer": "pip", "packages": tuple(sorted(packages)), "pip_check": False, "pip_version": ""}


def _ensure_in_child(cache: str, pip: dict, out) -> None:
    import io
    import contextlib
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        python, _fd = pipenv.ensure(cache, pip)
    out.put((python, err.getvalue()))


def test_several_workers_at_once_make_one_env_that_sees_the_base(tmp_path):
    wheel = tiny_wheel(tmp_path / "w1", "podium_pipdemo", "1.0", "one")
    pip = _set(str(wheel))
    cache = str(tmp_path / "cache")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(cache, pip, out)) for _ in range(3)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=240) for _ in procs]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    pythons = {python for python, _ in results}
    assert len(pythons) == 1, results
    made = [err for _, err in results if "made the pip virtualenv" in err]
    assert len(made) == 1, results  # one maker; the others waited and reused it
    python = pythons.pop()
    assert Path(python).parent.parent.parent == Path(cache)
    probe = subprocess.run([python, "-c", "import podium_pipdemo, podium.worker.host, sys; "
                            "print(podium_pipdemo.VALUE, sys.prefix)"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert probe == ["one", str(Path(python).parent.parent)]
    assert (Path(cache).stat().st_mode & 0o777) == 0o700  # private
    # The base's packages are below the set's own: the base lacks podium_pipdemo.
    assert subprocess.run([sys.executable, "-c", "import podium_pipdemo"], capture_output=True).returncode != 0


def test_a_failed_install_names_pips_lines_and_leaves_nothing(tmp_path):
    cache = tmp_path / "cache"
    bad = _set(str(tmp_path / "nowhere" / "podium_missing-1.0-py3-none-any.whl"))
    with pytest.raises(pipenv.SetupFailed) as caught:
        pipenv.ensure(cache, bad)
    assert "pip install failed" in str(caught.value) and "podium_missing" in str(caught.value)
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []
    # The launcher says so on stderr and exits 1 (the worker's FAILED report carries it).
    run = subprocess.run([*envlauncher.launcher_command(tmp_path, bad, "", ()), "-c", "print('never')"],
                         capture_output=True, text=True)
    assert run.returncode == SETUP_FAILED_EXIT and "runtime_env could not be set up" in run.stderr
    assert "pip install failed" in run.stderr
    assert "podium_missing" in run.stderr and "never" not in run.stdout


def test_uv_without_uv_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no uv binary here
    monkeypatch.setitem(sys.modules, "uv", None)  # and no uv package: its import fails
    uv_set = {**_set("anything"), "installer": "uv"}
    with pytest.raises(pipenv.SetupFailed, match="needs the uv binary.*pip install uv"):
        pipenv.ensure(tmp_path / "cache", uv_set)
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()] == []


def _has_uv() -> bool:
    try:
        import uv  # noqa: F401
        return True
    except ImportError:
        return shutil.which("uv") is not None


@pytest.mark.skipif(not _has_uv(), reason="needs uv (the uv binary on PATH or `pip install uv`)")
def test_uv_makes_the_env_with_uv(tmp_path):
    wheel = tiny_wheel(tmp_path / "w", "podium_pipdemo", "3.0", "three")
    python, fd = pipenv.ensure(tmp_path / "cache", {**_set(str(wheel)), "installer": "uv", "pip_check": True})
    os.close(fd)
    probe = subprocess.run([python, "-c", "import podium_pipdemo, podium.worker.host; print(podium_pipdemo.VALUE)"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "three"
    assert not Path(python).parent.joinpath("pip").exists()  # uv installs; the env has no pip of its own


def test_the_cache_is_bounded_and_keeps_sets_in_use(tmp_path):
    cache = tmp_path / "cache"
    sets = [_set(str(tiny_wheel(tmp_path / f"w{i}", "podium_pipdemo", f"{i}.0", str(i)))) for i in range(3)]
    first, held = pipenv.ensure(cache, sets[0], limit=2)  # held: a worker runs in it
    second, fd = pipenv.ensure(cache, sets[1], limit=2)
    os.close(fd)  # its worker ended
    third, fd = pipenv.ensure(cache, sets[2], limit=2)
    os.close(fd)
    assert Path(first).exists() and Path(third).exists()
    assert not Path(second).exists()  # the unused one went, not the older one in use
    os.close(held)
