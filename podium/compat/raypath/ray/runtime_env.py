"""``ray.runtime_env``: :class:`RuntimeEnv` and :class:`RuntimeEnvConfig`
(:mod:`podium.compat.rayruntimeenv`)."""

from podium.compat.rayruntimeenv import RuntimeEnv, RuntimeEnvConfig

__all__ = ["RuntimeEnv", "RuntimeEnvConfig"]
