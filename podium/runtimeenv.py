"""Ray's ``runtime_env``: which keys Podium honours, their bounds, and how a worker inherits them.

Podium honours ``env_vars``, ``py_executable`` (the command that starts the worker, split into
argv: an interpreter, or a prefix ending in one such as ``uv run --frozen python``),
``working_dir`` and ``py_modules`` (local paths, which must exist at the same place on the
worker's node: a shared filesystem or the same checkout; or package URIs, ``gcs://`` ones
uploaded to the cluster and ``https://`` zips, which the worker's node fetches and unpacks once:
:mod:`podium.worker.agent.packages`), and ``pip`` / ``uv`` (a list of
requirements, ``{"packages": [...], ...}``, or a requirements.txt path read here, as Ray reads
it on the driver): the worker's node makes one virtualenv per requirement set, inheriting its
base environment, and starts the worker by that virtualenv's python
(:mod:`podium.worker.agent.pipenv`). They travel in ``WorkerSpec.python_command`` /
``working_dir`` / ``py_modules`` / ``pip``. ``pip`` or ``uv`` with ``py_executable`` (or with each
other) is refused, as Ray refuses ``pip`` with ``conda``. Every other key is refused with what to
do instead (:data:`REFUSED`).

A worker inherits its creator's runtime environment as Ray's do: the agent puts the worker's
own ``{"py_executable", "working_dir", "py_modules", "pip"}`` in its environment as JSON under
:data:`ENV_KEY`, and ``ray.init(runtime_env=...)`` puts the driver's there, so actors and
tasks created there (verl's TaskRunner making its worker groups) default to it. A child's own
``pip``/``uv`` replaces an inherited ``py_executable`` and the other way round (both at once
cannot start one process).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from typing import Any, Mapping, Sequence

from podium.errors import InvalidArgumentError, UnimplementedError

__all__ = ["ENV_KEY", "MAX_COMMAND_ARGS", "MAX_COMMAND_CHARS", "MAX_PATH_CHARS", "MAX_PY_MODULES",
           "REFUSED", "RuntimeFields", "parse_runtime_env", "inherited", "to_env", "check_fields",
           "check_spec", "spec_kwargs", "parse_py_executable", "driver_env", "parse_pip", "MAX_PIP_PACKAGES",
           "MAX_PIP_CHARS", "PIP_INSTALLERS", "HONOURED_NOTE", "package_uri", "pip_fields", "merged_env", "PipFields",
           "launcher_command", "driver_command", "SETUP_FAILED_EXIT", "SETUP_FAILED_LINE"]

#: Environment variable holding a process's inherited runtime environment (JSON).
ENV_KEY = "PODIUM_RUNTIME_ENV"
#: Bounds of what a client may set.
MAX_COMMAND_ARGS = 64
MAX_COMMAND_CHARS = 8192
MAX_PATH_CHARS = 4096
MAX_PY_MODULES = 64
#: At most this many requirement lines in one ``pip``/``uv`` set, this many characters together
#: (a requirements.txt given by path is read up to this size).
MAX_PIP_PACKAGES = 256
MAX_PIP_CHARS = 65536
#: A package uploaded to the cluster (what Ray's clients name it).
_GCS_PACKAGE = re.compile(r"^gcs://_ray_pkg_[0-9a-f]{16,64}\.zip$")
#: The runtime_env keys that name a virtualenv's requirements, and the installer of each.
PIP_INSTALLERS = ("pip", "uv")
#: Keys of the dict form of each (Ray's), and the field each fills.
_PIP_OPTIONS = {"pip": {"packages", "pip_check", "pip_version", "pip_install_options"},
                "uv": {"packages", "uv_check", "uv_pip_install_options"}}
#: The installer options Ray's client fills in by default (``RuntimeEnv`` adds them): accepted, as
#: they change no installed file (Podium installs with its own options); any other is refused.
_DEFAULT_INSTALL_OPTIONS = {"pip_install_options": ["--disable-pip-version-check", "--no-cache-dir"],
                            "uv_pip_install_options": ["--no-cache"]}

#: How the launcher (podium.worker.agent.envlauncher) ends when a runtime environment cannot be
#: set up (sysexits' EX_CONFIG), and the line it writes on stderr first: a job's supervisor
#: tells a failed setup from a failed entrypoint by both.
SETUP_FAILED_EXIT = 78
SETUP_FAILED_LINE = "podium: the runtime_env could not be set up on this node:"

#: runtime_env keys Podium does not provide, and what to use instead.
REFUSED = {
    "conda": "activate the conda environment's python by runtime_env={'py_executable': "
             "'/path/to/conda/env/bin/python'}",
    "container": "run Podium's node agent inside the container instead",
    "image_uri": "run Podium's node agent inside the image instead",
    "nsight": "wrap the interpreter: runtime_env={'py_executable': 'nsys profile -o out python'}",
    "java_jars": "Podium runs Python workers only",
    "mpi": "use torch.distributed in the workers (MASTER_ADDR and MASTER_PORT are set)",
}
#: The keys Podium honours, as the Ray options table (podium.compat.rayoptions) states them.
HONOURED_NOTE = ("env_vars, py_executable, working_dir and py_modules (local paths, or packages: "
                 "gcs://_ray_pkg_<hash>.zip uploaded to the cluster, https://...zip), pip and uv (a "
                 "virtualenv per requirement set, made and cached on each node)")
#: Keys accepted with no effect: they tune how Ray builds an environment (``config``'s
#: ``setup_timeout_seconds`` among them: a pip set's install is bounded by Ray's default, 600 s,
#: podium.worker.agent.pipenv.SETUP_SECONDS).
_NO_EFFECT = {"config", "eager_install", "_inject_current_ray"}


class RuntimeFields(dict):
    """The honoured keys of one runtime_env, checked: ``py_executable`` (argv tuple),
    ``working_dir`` (absolute path), ``py_modules`` (tuple of absolute paths) and ``pip`` (the
    ``WorkerSpec.pip`` fields as a dict: installer, packages, pip_check, pip_version); a key
    absent is inherited from the creator."""


class PipFields(dict):
    """One ``pip``/``uv`` set as the ``WorkerSpec.pip`` fields (installer, packages as a tuple,
    pip_check, pip_version); hashable, since task pools are keyed by their runtime fields."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


def _requirements_file(key: str, path: str) -> list[str]:
    """The requirement lines of a requirements.txt ``path`` (read here, as Ray reads it on the
    driver): blank lines and comments left out."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as handle:
            text = handle.read(MAX_PIP_CHARS + 1)
    except OSError as exc:
        raise InvalidArgumentError(f"runtime_env[{key!r}] = {path!r}: a string names a requirements.txt, "
                                   f"which cannot be read here: {exc}") from None
    if len(text) > MAX_PIP_CHARS:
        raise InvalidArgumentError(f"runtime_env[{key!r}] requirements file {path!r} is over {MAX_PIP_CHARS} characters")
    return [line.split(" #", 1)[0] for line in text.splitlines() if not line.strip().startswith("#")]


def parse_pip(key: str, value: Any) -> PipFields:
    """``runtime_env['pip']`` or ``['uv']`` (``key``) in any of Ray's forms, as the
    ``WorkerSpec.pip`` fields: the requirement lines stripped, without duplicates, sorted (one
    set, one virtualenv); InvalidArgumentError for a form or size out of bounds."""
    options: Mapping[str, Any] = {}
    packages: Any = value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - _PIP_OPTIONS[key])
        if unknown:
            raise InvalidArgumentError(f"runtime_env[{key!r}] keys {unknown} are not supported by Podium "
                                       f"(it honours {sorted(_PIP_OPTIONS[key])})")
        options, packages = value, value.get("packages")
        for name, default in _DEFAULT_INSTALL_OPTIONS.items():
            if value.get(name) not in (None, [], default):
                raise InvalidArgumentError(f"runtime_env[{key!r}][{name!r}] = {value[name]!r}: Podium installs with "
                                           f"its own options and takes only Ray's default {default} here; put "
                                           f"index or constraint options in the requirement lines instead")
    if isinstance(packages, (str, os.PathLike)):
        packages = _requirements_file(key, os.fspath(packages))
    if not isinstance(packages, (list, tuple)) or not all(isinstance(p, str) for p in packages):
        raise InvalidArgumentError(f"runtime_env[{key!r}] must be a list of requirements, a requirements.txt "
                                   f"path or {{'packages': [...], ...}}, got {value!r}")
    lines = sorted({p.strip() for p in packages if p.strip()})
    if not lines or len(lines) > MAX_PIP_PACKAGES or sum(map(len, lines)) > MAX_PIP_CHARS \
            or any("\0" in p or "\n" in p for p in lines):
        raise InvalidArgumentError(f"runtime_env[{key!r}] needs 1 to {MAX_PIP_PACKAGES} requirement lines (one "
                                   f"requirement each, no newline or NUL) of "
                                   f"at most {MAX_PIP_CHARS} characters together, got {len(lines)}")
    check = options.get("pip_check", options.get("uv_check", False))
    version = options.get("pip_version") or ""
    if not isinstance(check, bool) or not isinstance(version, str) or len(version) > 100 or "\n" in version:
        raise InvalidArgumentError(f"runtime_env[{key!r}]: pip_check/uv_check must be a bool and pip_version "
                                   f"a version specifier such as '==23.2.1', got {check!r}, {version!r}")
    return PipFields(installer=key, packages=tuple(lines), pip_check=check, pip_version=version)


def parse_py_executable(value: Any) -> tuple[str, ...]:
    """``runtime_env['py_executable']`` as argv (InvalidArgumentError for one out of bounds)."""
    return _command(value)


def _command(value: Any) -> tuple[str, ...]:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgumentError(f"runtime_env['py_executable'] must be a non-empty command string, got {value!r}")
    if len(value) > MAX_COMMAND_CHARS:
        raise InvalidArgumentError(f"runtime_env['py_executable'] is {len(value)} characters; "
                                   f"at most {MAX_COMMAND_CHARS}")
    try:
        argv = tuple(shlex.split(value))
    except ValueError as exc:
        raise InvalidArgumentError(f"runtime_env['py_executable'] {value!r} is not a command line: {exc}") from None
    if len(argv) > MAX_COMMAND_ARGS or "\0" in value:
        raise InvalidArgumentError(f"runtime_env['py_executable'] has {len(argv)} arguments; "
                                   f"at most {MAX_COMMAND_ARGS}, without NUL")
    return argv


def package_uri(key: str, text: str) -> str:
    """``text`` if it is a package URI Podium fetches (``gcs://_ray_pkg_<hash>.zip``, uploaded to
    the cluster, or ``https://...zip``); UnimplementedError for another scheme,
    InvalidArgumentError for a malformed one."""
    scheme = text.partition("://")[0]
    if scheme not in ("gcs", "https"):
        raise UnimplementedError(
            f"runtime_env[{key!r}] = {text[:200]!r}: Podium fetches packages uploaded to the cluster "
            f"(gcs://_ray_pkg_<hash>.zip: `ray job submit --working-dir DIR` uploads one) and https:// "
            f"zip files, not {scheme}://; download it to a shared filesystem and give the local path, or "
            f"serve it over https")
    if len(text) > MAX_PATH_CHARS or any(c.isspace() or c == "\0" for c in text) or not (
            _GCS_PACKAGE.match(text) if scheme == "gcs" else text.split("?", 1)[0].endswith(".zip")):
        raise InvalidArgumentError(f"runtime_env[{key!r}] = {text[:200]!r} is not a package URI Podium takes: "
                                   f"gcs://_ray_pkg_<hex hash>.zip or https://HOST/PATH.zip (at most "
                                   f"{MAX_PATH_CHARS} characters)")
    return text


def _local_path(key: str, value: Any, *, directory: bool) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidArgumentError(f"runtime_env[{key!r}] must be a local path or a package URI, got {value!r}")
    text = os.fspath(value)
    if "://" in text:
        return package_uri(key, text)  # fetched and unpacked by the worker's node
    path = os.path.abspath(os.path.expanduser(text))
    if len(path) > MAX_PATH_CHARS or "\0" in path:
        raise InvalidArgumentError(f"runtime_env[{key!r}] path is longer than {MAX_PATH_CHARS} characters")
    if directory and not os.path.isdir(path):
        raise InvalidArgumentError(f"runtime_env[{key!r}] = {text!r} is not a directory here")
    if not directory and not (os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".py"))):
        raise InvalidArgumentError(f"runtime_env[{key!r}] entry {text!r} is neither a package "
                                   "directory nor a .py file here")
    return path


def parse_runtime_env(value: Any) -> tuple[dict[str, str], RuntimeFields]:
    """``(env_vars, fields)`` of a Ray ``runtime_env`` (a dict, or None). Keys set to None ask
    for Ray's default (verl passes ``working_dir: None``): nothing. Refused keys raise
    ``UnimplementedError`` naming the alternative."""
    if value is None:
        return {}, RuntimeFields()
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"runtime_env must be a dict, got {type(value).__name__}")
    fields = RuntimeFields()
    for key, item in value.items():
        if item is None or key == "env_vars" or key in _NO_EFFECT:
            continue
        if key in REFUSED:
            raise UnimplementedError(f"runtime_env key {key!r} is not supported by Podium: {REFUSED[key]}")
        if key == "py_executable":
            fields["py_executable"] = _command(item)
        elif key in PIP_INSTALLERS:
            if "pip" in fields:
                raise InvalidArgumentError("runtime_env sets both 'pip' and 'uv': give one (as Ray requires)")
            fields["pip"] = parse_pip(key, item)
        elif key == "working_dir":
            fields["working_dir"] = _local_path(key, item, directory=True)
        elif key == "py_modules":
            if not isinstance(item, (list, tuple)) or len(item) > MAX_PY_MODULES:
                raise InvalidArgumentError(f"runtime_env['py_modules'] must be a list of at most "
                                           f"{MAX_PY_MODULES} local paths, got {item!r}")
            fields["py_modules"] = tuple(_local_path(key, p, directory=False) for p in item)
        else:
            raise UnimplementedError(f"runtime_env key {key!r} is not supported by Podium (it honours "
                                     "env_vars, py_executable, working_dir, py_modules, pip and uv)")
    if "pip" in fields and "py_executable" in fields:
        raise InvalidArgumentError(f"runtime_env sets {fields['pip']['installer']!r} and 'py_executable': a "
                                   "worker runs in the virtualenv Podium makes or in the given interpreter, not "
                                   "both (put the packages in that interpreter's environment instead)")
    env = value.get("env_vars") or {}
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise InvalidArgumentError("runtime_env['env_vars'] must map str to str")
    return dict(env), fields


def inherited(environ: Mapping[str, str] | None = None) -> RuntimeFields:
    """The runtime environment this process passes on (:data:`ENV_KEY`; empty without one)."""
    text = (os.environ if environ is None else environ).get(ENV_KEY, "")
    if not text:
        return RuntimeFields()
    try:
        doc = json.loads(text)
    except ValueError:
        return RuntimeFields()
    out = RuntimeFields()
    if doc.get("py_executable"):
        out["py_executable"] = tuple(doc["py_executable"])
    if doc.get("working_dir"):
        out["working_dir"] = str(doc["working_dir"])
    if doc.get("py_modules"):
        out["py_modules"] = tuple(doc["py_modules"])
    if doc.get("pip"):
        pip = doc["pip"]
        out["pip"] = PipFields(installer=pip["installer"], packages=tuple(pip["packages"]),
                               pip_check=bool(pip.get("pip_check")), pip_version=pip.get("pip_version", ""))
    return out


def _merge(own: Mapping[str, Any]) -> dict[str, Any]:
    """This process's inherited fields under ``own``, key by key; an own ``pip`` drops an
    inherited ``py_executable`` and the other way round (one process has one interpreter)."""
    base = dict(inherited())
    if "pip" in own:
        base.pop("py_executable", None)
    if "py_executable" in own:
        base.pop("pip", None)
    return {**base, **own}


def spec_kwargs(fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``WorkerSpec`` keyword arguments (python_command, working_dir, py_modules) of a
    worker created here: ``fields`` over this process's :func:`inherited` ones (Ray's rule: a
    child inherits its parent's runtime_env, key by key)."""
    merged = _merge(fields or {})
    out = {"python_command": list(merged.get("py_executable", ())),
           "working_dir": merged.get("working_dir", ""),
           "py_modules": list(merged.get("py_modules", ()))}
    if merged.get("pip"):
        out["pip"] = {**merged["pip"], "packages": list(merged["pip"]["packages"])}
    return out


def merged_env(fields: Mapping[str, Any]) -> str:
    """The :data:`ENV_KEY` value of this process once ``ray.init`` gave ``fields``."""
    merged = _merge(fields)
    return to_env(merged.get("py_executable", ()), merged.get("working_dir", ""),
                  merged.get("py_modules", ()), merged.get("pip"))


def pip_fields(spec: Any) -> PipFields | None:
    """``WorkerSpec.pip`` as the dict :func:`parse_pip` returns, None when unset."""
    pip = spec.pip
    if not pip.packages:
        return None
    return PipFields(installer=pip.installer, packages=tuple(pip.packages), pip_check=pip.pip_check,
                     pip_version=pip.pip_version)


def to_env(python_command: Sequence[str], working_dir: str, py_modules: Sequence[str],
           pip: Mapping[str, Any] | None = None) -> str:
    """The :data:`ENV_KEY` value of a worker with these fields ("" when it has none)."""
    if not (python_command or working_dir or py_modules or pip):
        return ""
    doc: dict[str, Any] = {"py_executable": list(python_command), "working_dir": working_dir,
                           "py_modules": list(py_modules)}
    if pip:
        doc["pip"] = {**pip, "packages": list(pip["packages"])}
    return json.dumps(doc)


def driver_env(py_executable: str | None, pip: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The variables of a submitted job's driver whose runtime_env sets ``py_executable`` or a
    ``pip``/``uv`` set: the actors and tasks it creates inherit it ({} without either)."""
    if not (py_executable or pip):
        return {}
    return {ENV_KEY: to_env(_command(py_executable) if py_executable else (), "", (), pip)}


def launcher_command(state_dir: str | os.PathLike, pip: Mapping[str, Any] | None, working_dir: str,
                     py_modules: Sequence[str]) -> tuple[str, ...]:
    """The command prefix (ARGV follows) that sets a runtime environment up on this node and
    then execs ARGV (podium.worker.agent.envlauncher; named here, not imported, so the
    scheduler's job drivers start by it too). ``state_dir`` holds the node's caches."""
    spec = {"pip": {**pip, "packages": list(pip["packages"])} if pip else None,
            "working_dir": working_dir, "py_modules": list(py_modules)}
    return (sys.executable, "-m", "podium.worker.agent.envlauncher", os.fspath(state_dir),
            json.dumps(spec, sort_keys=True), "--")


def driver_command(state_dir: str | os.PathLike, pip: Mapping[str, Any] | None, argv: Sequence[str]) -> list[str]:
    """How a submitted job's driver ``argv`` starts: ``podium run -- ARGV`` by this interpreter,
    or, with a ``pip``/``uv`` set, by the python of that set's virtualenv in ``state_dir``'s
    cache (the launcher makes or finds it, as for a worker, and activates it: the entrypoint's
    ``python`` is the virtualenv's)."""
    run = ["-m", "podium.cli", "run", "--", *argv]
    return [*launcher_command(state_dir, pip, "", ()), *run] if pip else [sys.executable, *run]


def check_fields(python_command: Sequence[str], working_dir: str, py_modules: Sequence[str],
                 label: str = "worker", pip: Mapping[str, Any] | None = None) -> None:
    """InvalidArgumentError unless the runtime fields of a worker spec are within bounds."""
    if pip:
        if pip["installer"] not in PIP_INSTALLERS or python_command:
            raise InvalidArgumentError(f"{label}: pip.installer must be one of {PIP_INSTALLERS}, without "
                                       "python_command")
        parse_pip("pip", {"packages": list(pip["packages"]), "pip_check": pip["pip_check"],
                          "pip_version": pip["pip_version"]})
    if len(python_command) > MAX_COMMAND_ARGS or sum(map(len, python_command)) > MAX_COMMAND_CHARS \
            or any("\0" in a for a in python_command):
        raise InvalidArgumentError(f"{label}: python_command has more than {MAX_COMMAND_ARGS} arguments "
                                   f"or {MAX_COMMAND_CHARS} characters (or a NUL)")
    if len(py_modules) > MAX_PY_MODULES:
        raise InvalidArgumentError(f"{label}: more than {MAX_PY_MODULES} py_modules")
    for path in (working_dir, *py_modules):
        if "://" in path:
            try:
                package_uri("working_dir/py_modules", path)
            except (InvalidArgumentError, UnimplementedError) as exc:
                raise InvalidArgumentError(f"{label}: {exc}") from None
        elif len(path) > MAX_PATH_CHARS or "\0" in path or (path and not os.path.isabs(path)):
            raise InvalidArgumentError(f"{label}: runtime path {path[:100]!r} is not an absolute path "
                                       f"of at most {MAX_PATH_CHARS} characters")


def check_spec(spec: Any, label: str = "worker") -> None:
    """:func:`check_fields` of a ``WorkerSpec``."""
    check_fields(tuple(spec.python_command), spec.working_dir, tuple(spec.py_modules), label, pip_fields(spec))
