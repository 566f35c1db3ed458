"""DataProto's global switches (``DataProtoConfig``) and the keys it shares with dispatch."""

from __future__ import annotations

import os

from podium.errors import InvalidArgumentAssertion

__all__ = ["DataProtoConfig", "PADDING_SIZE_KEY", "AUTO_PADDING_KEY"]

#: The kwarg the dispatcher uses to pass the padding size to the collector
#: (verl's ``_padding_size_key``; the value is verl's).
PADDING_SIZE_KEY = "_padding_size_key_x123d"
#: The ``meta_info`` key that turns auto-padding on for one DataProto (verl's).
AUTO_PADDING_KEY = "_verl_auto_padding"


class _DataProtoConfigMeta(type):
    """Makes ``DataProtoConfig.auto_padding`` a class-level property."""

    _config: dict[str, bool] = {}
    auto_padding_key = AUTO_PADDING_KEY

    @property
    def auto_padding(cls) -> bool:
        """True when auto-padding is on for every DataProto (class flag or env)."""
        by_env = os.getenv("VERL_AUTO_PADDING", "FALSE").upper() in ("TRUE", "1")
        return by_env or cls._config.get(cls.auto_padding_key, False)

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise InvalidArgumentAssertion(f"enabled must be a boolean, got {enabled} as {type(enabled)}")
        cls._config[cls.auto_padding_key] = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Global DataProto switches: ``DataProtoConfig.auto_padding = True`` turns on
    auto-padding for every DataProto (as does env ``VERL_AUTO_PADDING=1|true``)."""
