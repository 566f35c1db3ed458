"""What ``ray.runtime_env`` holds: :class:`RuntimeEnv` and :class:`RuntimeEnvConfig`, Ray's
runtime_env dict as classes (ROLL and NeMo-RL build them; vLLM reads
``ray.get_runtime_context().runtime_env``). Podium honours what
:mod:`podium.runtimeenv` lists; the others are refused when the dict is used."""

from __future__ import annotations

from typing import Any

__all__ = ["RuntimeEnv", "RuntimeEnvConfig"]


class RuntimeEnvConfig(dict):
    """``RuntimeEnvConfig(setup_timeout_seconds=..., eager_install=...)``: how Ray builds an
    environment; accepted with no effect (a ``pip`` set's install is bounded by Ray's default
    600 s, and built when its first worker starts)."""

    def __init__(self, setup_timeout_seconds: int = 600, eager_install: bool = True,
                 log_files: list[str] | None = None) -> None:
        super().__init__(setup_timeout_seconds=setup_timeout_seconds, eager_install=eager_install)
        if log_files is not None:
            self["log_files"] = log_files


class RuntimeEnv(dict):
    """``RuntimeEnv(py_executable=..., working_dir=..., env_vars=..., ...)``: the same dict as
    ``runtime_env={...}``; keys whose value is None are left out, as in Ray."""

    def __init__(self, *, py_modules: list | None = None, working_dir: str | None = None,
                 pip: Any = None, conda: Any = None, container: Any = None,
                 env_vars: dict[str, str] | None = None, worker_process_setup_hook: Any = None,
                 nsight: Any = None, config: dict | RuntimeEnvConfig | None = None,
                 _validate: bool = True, mpi: Any = None, image_uri: str | None = None,
                 uv: Any = None, **kwargs: Any) -> None:
        given = dict(py_modules=py_modules, working_dir=working_dir, pip=pip, conda=conda,
                     container=container, env_vars=env_vars, nsight=nsight, config=config, mpi=mpi,
                     image_uri=image_uri, uv=uv, worker_process_setup_hook=worker_process_setup_hook,
                     **kwargs)
        super().__init__({k: v for k, v in given.items() if v is not None})

    def to_dict(self) -> dict:
        """The plain dict (Ray's ``RuntimeEnv.to_dict``)."""
        return dict(self)

    def env_vars(self) -> dict[str, str]:
        """Its ``env_vars`` ({} without)."""
        return dict(self.get("env_vars") or {})

    def py_executable(self) -> str | None:
        """Its ``py_executable``, or None."""
        return self.get("py_executable")

    def working_dir(self) -> str:
        """Its ``working_dir`` ("" without)."""
        return self.get("working_dir") or ""
