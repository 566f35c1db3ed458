"""The launcher in front of a worker whose runtime environment is set up on its node first:
``pip``/``uv`` (a virtualenv, :mod:`podium.worker.agent.pipenv`) or a package URI as
``working_dir`` or in ``py_modules`` (:mod:`podium.worker.agent.packages`).

The agent starts the worker's process as ``python -m podium.worker.agent.envlauncher STATE_DIR
SPEC -- ARGV...`` (behind the exec shim, with the worker's ready pipe and log files: the
spawner's one exec path). The launcher fetches and unpacks the packages, makes or finds the
virtualenv, enters the working_dir (the cwd, first on ``PYTHONPATH``), puts the py_modules on
``PYTHONPATH`` (an unpacked package folder itself, as Ray does; a local one through the agent's
folder of links), and then becomes the worker with ``exec``: ARGV as given (the py_executable or
the agent's worker command), or, with ``pip``, the virtualenv's python followed by ARGV, with the
virtualenv activated (``VIRTUAL_ENV``, its ``bin`` first on ``PATH``). The locks it holds shared
on what it uses stay open across ``exec``, so neither cache evicts them while the worker lives.
A setup that fails exits :data:`~podium.runtimeenv.SETUP_FAILED_EXIT` with the reason on stderr,
which the worker's FAILED report carries (its creator's ``WorkerDiedError``). A submitted job's
driver with ``pip``/``uv`` starts behind it too (:func:`podium.runtimeenv.driver_command`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import sys
from typing import Any, Mapping, Sequence

from podium.runtimeenv import SETUP_FAILED_EXIT, SETUP_FAILED_LINE, launcher_command
from podium.worker.agent import packages, pipenv

__all__ = ["needs_launcher", "launcher_command", "link_modules", "main"]


def needs_launcher(pip: Mapping[str, Any] | None, working_dir: str, py_modules: Sequence[str]) -> bool:
    """Whether a worker with these runtime fields starts behind the launcher."""
    return bool(pip) or packages.is_uri(working_dir) or any(packages.is_uri(m) for m in py_modules)


def link_modules(folder: pathlib.Path, py_modules: Sequence[str]) -> str:
    """A folder (under ``folder``, one per set of modules) holding a link named like each of
    ``py_modules`` to it, so each imports by its name and nothing beside it does; "" for none.
    FileNotFoundError naming the module when one is not on this node."""
    if not py_modules:
        return ""
    for path in py_modules:
        if not os.path.exists(path):
            raise FileNotFoundError(f"runtime_env py_modules entry {path!r} does not exist on this node")
    key = hashlib.sha256("\0".join(py_modules).encode()).hexdigest()[:16]
    target = folder / key
    if not target.is_dir():
        staging = folder / f".{key}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for path in py_modules:
            (staging / os.path.basename(path.rstrip("/"))).symlink_to(path)
        try:
            staging.rename(target)
        except OSError:  # another spawn made it first
            shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _setup(state_dir: pathlib.Path, spec: Mapping[str, Any], argv: list[str]) -> tuple[list[str], list[int]]:
    """Set this process up as ``spec`` asks; the argv to exec and the lock descriptors held."""
    held: list[int] = []
    working_dir = spec.get("working_dir") or ""
    if packages.is_uri(working_dir):
        working_dir, fd = packages.fetch(state_dir / packages.CACHE_DIR, working_dir)
        held.append(fd)
    elif working_dir and not os.path.isdir(working_dir):
        raise FileNotFoundError(f"runtime_env working_dir {working_dir!r} is not a directory on this node")
    unpacked, local = [], []
    for module in spec.get("py_modules") or ():
        if packages.is_uri(module):
            folder, fd = packages.fetch(state_dir / packages.CACHE_DIR, module)
            held.append(fd)
            unpacked.append(folder)
        else:
            local.append(module)
    front = [p for p in (working_dir, *unpacked, link_modules(state_dir / "py_modules", tuple(local))) if p]
    if front:
        os.environ["PYTHONPATH"] = os.pathsep.join([*front, *filter(None, [os.environ.get("PYTHONPATH", "")])])
    if spec.get("pip"):
        python, fd = pipenv.ensure(state_dir / pipenv.CACHE_DIR, spec["pip"])
        held.append(fd)
        argv = [python, *argv]
        # Activated, as Ray's pip env is: a `python` the process runs (a job's entrypoint) is
        # the virtualenv's.
        venv = os.path.dirname(os.path.dirname(python))
        os.environ["VIRTUAL_ENV"] = venv
        os.environ["PATH"] = os.pathsep.join([os.path.join(venv, "bin"), *filter(None, [os.environ.get("PATH")])])
    if working_dir:
        os.chdir(working_dir)
    return argv, held


def main(argv: Sequence[str]) -> int:
    """``STATE_DIR SPEC -- ARGV...``: set up, then exec (see the module docstring)."""
    state, spec_text, _dash, *rest = argv
    try:
        command, held = _setup(pathlib.Path(state), json.loads(spec_text), list(rest))
    except (pipenv.SetupFailed, OSError) as exc:
        sys.stderr.write(f"{SETUP_FAILED_LINE} {exc}\n")
        return SETUP_FAILED_EXIT
    for fd in held:
        os.set_inheritable(fd, True)  # held shared by the worker for its life (eviction skips it)
    sys.stderr.flush()
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        sys.stderr.write(f"podium: {command[0]!r} did not start: {exc}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
