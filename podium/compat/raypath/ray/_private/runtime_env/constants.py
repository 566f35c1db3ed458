"""``ray._private.runtime_env.constants``: the environment variable names code reads."""

from __future__ import annotations

#: Ray puts the job's config (JSON) here in its workers; Podium never sets it, so code that
#: reads it (verl) sees no job config, as a driver outside a Ray job does.
RAY_JOB_CONFIG_JSON_ENV_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"

__all__ = ["RAY_JOB_CONFIG_JSON_ENV_VAR"]
