"""Ray's ``runtime_env``: which keys Podium honours, their bounds, and how a worker inherits them.

Podium honours ``env_vars``, ``py_executable`` (the command that starts the worker, split into
argv: an interpreter, or a prefix ending in one such as ``uv run --frozen python``),
``working_dir`` and ``py_modules`` (local paths, which must exist at the same place on the
worker's node: a shared filesystem or the same checkout). They travel in
``WorkerSpec.python_command`` / ``working_dir`` / ``py_modules``. Every other key is refused
with what to do instead (:data:`REFUSED`).

A worker inherits its creator's runtime environment as Ray's do: the agent puts the worker's
own ``{"py_executable", "working_dir", "py_modules"}`` in its environment as JSON under
:data:`ENV_KEY`, and ``ray.init(runtime_env=...)`` puts the driver's there, so actors and
tasks created there (verl's TaskRunner making its worker groups) default to it.
"""

from __future__ import annotations

import json
import os
import shlex
from typing import Any, Mapping, Sequence

from podium.errors import InvalidArgumentError, UnimplementedError

__all__ = ["ENV_KEY", "MAX_COMMAND_ARGS", "MAX_COMMAND_CHARS", "MAX_PATH_CHARS", "MAX_PY_MODULES",
           "REFUSED", "RuntimeFields", "parse_runtime_env", "inherited", "to_env", "check_fields",
           "check_spec", "spec_kwargs", "parse_py_executable", "driver_env"]

#: Environment variable holding a process's inherited runtime environment (JSON).
ENV_KEY = "PODIUM_RUNTIME_ENV"
#: Bounds of what a client may set.
MAX_COMMAND_ARGS = 64
MAX_COMMAND_CHARS = 8192
MAX_PATH_CHARS = 4096
MAX_PY_MODULES = 64

#: runtime_env keys Podium does not provide, and what to use instead.
_ENV_ALTERNATIVE = ("create a virtualenv with those packages on each node (or use `uv run --with PKG "
                    "python`) and set runtime_env={'py_executable': '/path/to/venv/bin/python'}")
REFUSED = {
    "pip": _ENV_ALTERNATIVE,
    "uv": _ENV_ALTERNATIVE,
    "conda": "activate the conda environment's python by runtime_env={'py_executable': "
             "'/path/to/conda/env/bin/python'}",
    "container": "run Podium's node agent inside the container instead",
    "image_uri": "run Podium's node agent inside the image instead",
    "nsight": "wrap the interpreter: runtime_env={'py_executable': 'nsys profile -o out python'}",
    "java_jars": "Podium runs Python workers only",
    "mpi": "use torch.distributed in the workers (MASTER_ADDR and MASTER_PORT are set)",
}
#: Keys accepted with no effect: they tune how Ray builds an environment, which Podium never does.
_NO_EFFECT = {"config", "eager_install", "_inject_current_ray"}


class RuntimeFields(dict):
    """The honoured keys of one runtime_env, checked: ``py_executable`` (argv tuple),
    ``working_dir`` (absolute path) and ``py_modules`` (tuple of absolute paths); a key absent
    is inherited from the creator."""


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


def _local_path(key: str, value: Any, *, directory: bool) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidArgumentError(f"runtime_env[{key!r}] must be a local path, got {value!r}")
    text = os.fspath(value)
    if "://" in text:
        raise UnimplementedError(
            f"runtime_env[{key!r}] = {text!r}: Podium takes a local path (present at the same place "
            f"on every node, e.g. a shared filesystem), not a package URI; a submitted job "
            f"(`ray job submit --working-dir`) already runs in its unpacked working_dir")
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
        elif key == "working_dir":
            fields["working_dir"] = _local_path(key, item, directory=True)
        elif key == "py_modules":
            if not isinstance(item, (list, tuple)) or len(item) > MAX_PY_MODULES:
                raise InvalidArgumentError(f"runtime_env['py_modules'] must be a list of at most "
                                           f"{MAX_PY_MODULES} local paths, got {item!r}")
            fields["py_modules"] = tuple(_local_path(key, p, directory=False) for p in item)
        else:
            raise UnimplementedError(f"runtime_env key {key!r} is not supported by Podium (it honours "
                                     "env_vars, py_executable, working_dir and py_modules)")
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
    return out


def spec_kwargs(fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``WorkerSpec`` keyword arguments (python_command, working_dir, py_modules) of a
    worker created here: ``fields`` over this process's :func:`inherited` ones (Ray's rule: a
    child inherits its parent's runtime_env, key by key)."""
    merged = {**inherited(), **(fields or {})}
    return {"python_command": list(merged.get("py_executable", ())),
            "working_dir": merged.get("working_dir", ""),
            "py_modules": list(merged.get("py_modules", ()))}


def to_env(python_command: Sequence[str], working_dir: str, py_modules: Sequence[str]) -> str:
    """The :data:`ENV_KEY` value of a worker with these fields ("" when it has none)."""
    if not (python_command or working_dir or py_modules):
        return ""
    return json.dumps({"py_executable": list(python_command), "working_dir": working_dir,
                       "py_modules": list(py_modules)})


def driver_env(py_executable: str | None) -> dict[str, str]:
    """The variables of a submitted job's driver whose runtime_env sets ``py_executable``: the
    actors and tasks it creates inherit it ({} without one)."""
    return {ENV_KEY: to_env(_command(py_executable), "", ())} if py_executable else {}


def check_fields(python_command: Sequence[str], working_dir: str, py_modules: Sequence[str],
                 label: str = "worker") -> None:
    """InvalidArgumentError unless the runtime fields of a worker spec are within bounds."""
    if len(python_command) > MAX_COMMAND_ARGS or sum(map(len, python_command)) > MAX_COMMAND_CHARS \
            or any("\0" in a for a in python_command):
        raise InvalidArgumentError(f"{label}: python_command has more than {MAX_COMMAND_ARGS} arguments "
                                   f"or {MAX_COMMAND_CHARS} characters (or a NUL)")
    if len(py_modules) > MAX_PY_MODULES:
        raise InvalidArgumentError(f"{label}: more than {MAX_PY_MODULES} py_modules")
    for path in (working_dir, *py_modules):
        if len(path) > MAX_PATH_CHARS or "\0" in path or (path and not os.path.isabs(path)):
            raise InvalidArgumentError(f"{label}: runtime path {path[:100]!r} is not an absolute path "
                                       f"of at most {MAX_PATH_CHARS} characters")


def check_spec(spec: Any, label: str = "worker") -> None:
    """:func:`check_fields` of a ``WorkerSpec``."""
    check_fields(tuple(spec.python_command), spec.working_dir, tuple(spec.py_modules), label)
