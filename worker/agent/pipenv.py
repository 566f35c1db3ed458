"""runtime_env ``pip`` / ``uv``: one virtualenv per requirement set on a node, made by the worker
that first needs it, then reused.

A worker whose spec has ``pip`` starts as a ``py_executable`` worker does (the spawner's exec
path, :func:`podium.worker.agent.workerenv.foreign_command`) behind the launcher
(:mod:`podium.worker.agent.envlauncher`): run by the agent's own interpreter, it calls
:func:`ensure` and then ``exec``s the virtualenv's python with the worker host's arguments, so
the pid, the ready pipe and the log files stay the worker's. A failed install ends that process
with pip's last lines on stderr: the worker is FAILED and its creator gets a ``WorkerDiedError``
carrying them (Ray raises ``RuntimeEnvSetupError``).

The cache (:data:`CACHE_DIR` under the node's log folder, private) holds, per set:

- ``<key>/``: the virtualenv, ``<key>`` the hash of the normalised set, the installer options
  and the base interpreter (:func:`env_key`). Made with ``--system-site-packages`` plus a
  ``.pth`` adding the base environment's site folders when the base is itself a virtualenv
  (``--system-site-packages`` alone reaches only the *system* interpreter's), so Podium's
  worker host and the node's packages import in it, below the set's own.
- ``<key>/.podium-ready``: written last; a folder without it is half made and is made again.
- ``<key>.lock``: ``flock`` on it. The maker holds it exclusively (several workers asking at
  once: one makes, the others wait and reuse); each worker running in the env holds it shared
  for its whole life (the descriptor stays open across ``exec``), so eviction
  (:data:`MAX_ENVS` sets, least recently used first) removes only a set no live worker uses.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import sysconfig
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from podium.private import private_dir

__all__ = ["CACHE_DIR", "MAX_ENVS", "SETUP_SECONDS", "READY_NAME", "env_key", "open_lock", "ensure",
           "SetupFailed"]

#: The cache's folder under the node agent's log folder.
CACHE_DIR = "runtime_envs/pip"
#: At most this many virtualenvs in one node's cache (a count, not bytes: a set's size is known
#: only once installed). Making one more first removes the least recently used unused ones.
MAX_ENVS = 16
#: Longest one install may take (Ray's ``setup_timeout_seconds`` default).
SETUP_SECONDS = 600.0
#: The marker a finished virtualenv holds.
READY_NAME = ".podium-ready"
#: Lines of the installer's output a failure reports.
_TAIL_LINES = 30


class SetupFailed(Exception):
    """The virtualenv could not be made; the message holds the command and its last lines."""


def env_key(pip: Mapping[str, Any], python: str = sys.executable) -> str:
    """The cache key of a requirement set (already normalised by podium.runtimeenv.parse_pip)
    made from the base interpreter ``python``."""
    doc = {"installer": pip["installer"], "packages": sorted(pip["packages"]),
           "pip_check": bool(pip.get("pip_check")), "pip_version": pip.get("pip_version", ""),
           "python": os.path.realpath(python), "version": sys.version}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def open_lock(path: pathlib.Path, how: int) -> int:
    """A descriptor of ``path`` locked ``how`` (LOCK_SH / LOCK_EX); reopened when an eviction
    removed the file while we waited, so the lock held is the one the path names."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, how)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _tail(text: str) -> str:
    return "\n".join(text.strip().splitlines()[-_TAIL_LINES:])


def _run(argv: Sequence[str], what: str, deadline: float) -> None:
    """Run one step of the setup; SetupFailed with its last lines when it fails."""
    try:
        done = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise SetupFailed(f"{what} took longer than {SETUP_SECONDS:.0f} s: {' '.join(argv)}") from None
    except OSError as exc:
        raise SetupFailed(f"{what} did not start: {' '.join(argv)}: {exc}") from None
    if done.returncode != 0:
        raise SetupFailed(f"{what} failed (exit {done.returncode}): {' '.join(argv)}\n"
                          f"{_tail(done.stdout + chr(10) + done.stderr)}")


def _uv_binary() -> str:
    """The ``uv`` to install with: on PATH, or from the uv package of this interpreter."""
    found = shutil.which("uv")
    if found:
        return found
    try:
        from uv import find_uv_bin
        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        raise SetupFailed(f"runtime_env 'uv' needs the uv binary on this node: no `uv` on PATH and no uv "
                          f"package in {sys.executable} (install it: `pip install uv`), or use "
                          f"runtime_env 'pip'") from None


def _inherit_base(target: pathlib.Path) -> None:
    """Let the virtualenv see the base environment's packages (after its own): a ``.pth``
    adding this interpreter's site folders when it is a virtualenv itself."""
    if sys.prefix == sys.base_prefix:
        return  # --system-site-packages already reaches them
    purelib = sysconfig.get_path("purelib", vars={"base": str(target), "platbase": str(target)})
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages())
    pathlib.Path(purelib, "podium_base_env.pth").write_text(lines)


def _build(target: pathlib.Path, pip: Mapping[str, Any]) -> None:
    """Make the virtualenv at ``target`` (absent) and install the set in it."""
    deadline = time.monotonic() + SETUP_SECONDS
    uv = _uv_binary() if pip["installer"] == "uv" else ""
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(target)],
         "making the virtualenv", deadline)
    _inherit_base(target)
    python = str(target / "bin" / "python")
    requirements = target / "requirements.txt"
    requirements.write_text("".join(f"{line}\n" for line in pip["packages"]))
    if uv:
        _run([uv, "pip", "install", "--python", python, "-r", str(requirements)], "uv pip install", deadline)
        if pip.get("pip_check"):
            _run([uv, "pip", "check", "--python", python], "uv pip check", deadline)
        return
    # pip of the base environment (visible through the .pth) installs into the virtualenv; its
    # own pip only where the base has none or a version is asked.
    own_pip = bool(pip.get("pip_version")) or subprocess.run(
        [python, "-c", "import pip"], capture_output=True).returncode != 0
    if own_pip:
        _run([python, "-m", "ensurepip", "--default-pip"], "ensurepip", deadline)
    if pip.get("pip_version"):
        _run([python, "-m", "pip", "install", "--disable-pip-version-check", f"pip{pip['pip_version']}"],
             "installing pip" + pip["pip_version"], deadline)
    _run([python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "-r", str(requirements)],
         "pip install", deadline)
    if pip.get("pip_check"):
        _run([python, "-m", "pip", "check"], "pip check", deadline)


def evict_unused(cache: pathlib.Path, keep: str, limit: int,
                 marker: Callable[[pathlib.Path], pathlib.Path]) -> None:
    """Remove the least recently used entries (folders) of ``cache`` beyond ``limit - 1`` (room
    for ``keep``) that no worker uses and nobody is making (their lock is free). ``marker`` is
    an entry's ready file, whose time is its last use; an entry without one goes first."""
    folders = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != keep]

    def used_at(folder: pathlib.Path) -> float:
        with contextlib.suppress(OSError):
            return marker(folder).stat().st_mtime
        return 0.0  # half made

    excess = len(folders) - limit + 1
    for folder in sorted(folders, key=used_at):
        if excess <= 0:
            return
        lock = cache / f"{folder.name}.lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # in use
        try:
            marker(folder).unlink(missing_ok=True)
            shutil.rmtree(folder, ignore_errors=True)
            lock.unlink(missing_ok=True)  # waiters reopen (see open_lock)
            excess -= 1
        finally:
            os.close(fd)


@contextlib.contextmanager
def _exclusive(lock: pathlib.Path) -> Iterator[int]:
    fd = open_lock(lock, fcntl.LOCK_EX)
    try:
        yield fd
    except BaseException:
        os.close(fd)
        raise


def ensure(cache: str | os.PathLike, pip: Mapping[str, Any], limit: int = MAX_ENVS) -> tuple[str, int]:
    """``(python, fd)``: the python of ``pip``'s virtualenv in ``cache``, made first if needed,
    and a descriptor holding its lock shared (keep it open while the env is in use).
    SetupFailed when the install fails (nothing half made is left)."""
    folder = private_dir(cache)
    key = env_key(pip)
    target, lock = folder / key, folder / f"{key}.lock"
    python = str(target / "bin" / "python")
    fd = open_lock(lock, fcntl.LOCK_SH)
    if (target / READY_NAME).exists():
        os.utime(target / READY_NAME)  # recently used: evicted last
        return python, fd
    os.close(fd)
    with _exclusive(lock) as fd:
        if not (target / READY_NAME).exists():  # nobody made it while we waited
            shutil.rmtree(target, ignore_errors=True)  # a maker that died mid-way
            evict_unused(folder, key, limit, lambda entry: entry / READY_NAME)
            try:
                _build(target, pip)
            except BaseException:
                shutil.rmtree(target, ignore_errors=True)
                raise
            (target / READY_NAME).write_text(json.dumps({**pip, "packages": list(pip["packages"])}))
            sys.stderr.write(f"podium: made the {pip['installer']} virtualenv {target} "
                             f"({len(pip['packages'])} requirement(s))\n")
        fcntl.flock(fd, fcntl.LOCK_SH)  # made: from now on only used
    return python, fd
