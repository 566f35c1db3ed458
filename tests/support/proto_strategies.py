"""Hypothesis strategies and fillers for any protobuf message, built from its descriptor.

Strings in fields that name an address or host are loopback addresses only, so a
generated request never makes a service resolve or dial anything off this machine.
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1), F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}
_LOOPBACK = ("127.0.0.1", "127.0.0.9", "")


def _is_address(field) -> bool:
    name = field.name.lower()
    return "address" in name or name in ("host", "hostname", "target")


def _is_map(field) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _scalar(field) -> st.SearchStrategy:
    if field.type == F.TYPE_STRING:
        if _is_address(field):
            return st.sampled_from(_LOOPBACK)
        # Small alphabets hit real ids ("w-1") and edge cases (empty, unicode) alike.
        return st.one_of(st.text(max_size=12), st.from_regex(r"\A[a-z]-[0-9]\Z"))
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type in _INT_RANGES:
        low, high = _INT_RANGES[field.type]
        # Small values are the interesting ones (ranks, counts); extremes too.
        return st.one_of(st.integers(-3, 16).filter(lambda v: low <= v <= high), st.integers(low, high))
    if field.type == F.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if field.type == F.TYPE_FLOAT:
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if field.type == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-2, 40))  # proto3 enums are open
    raise TypeError(f"no strategy for field {field.full_name} type {field.type}")


def _value(field, depth: int) -> st.SearchStrategy:
    if field.type == F.TYPE_MESSAGE:
        return message_dicts(field.message_type, depth + 1)
    return _scalar(field)


def message_dicts(descriptor, depth: int = 0) -> st.SearchStrategy:
    """Dicts ``{field: value}`` for messages of ``descriptor`` (some fields left out)."""
    parts = {}
    for field in descriptor.fields:
        if field.type == F.TYPE_MESSAGE and depth >= 2 and not _is_map(field):
            continue  # deep nesting adds no new handler paths, only time
        if _is_map(field):
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            strategy = st.dictionaries(_scalar(key), _value(value, depth), max_size=3)
        elif field.is_repeated:
            strategy = st.lists(_value(field, depth), max_size=3)
        else:
            strategy = _value(field, depth)
        parts[field.name] = st.one_of(st.none(), strategy)
    return st.fixed_dictionaries(parts).map(lambda d: {k: v for k, v in d.items() if v is not None})


def _assign(message, values: dict) -> None:
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        if _is_map(field):
            target = getattr(message, name)
            for k, v in value.items():
                if field.message_type.fields_by_name["value"].type == F.TYPE_MESSAGE:
                    _assign(target[k], v)
                else:
                    target[k] = v
        elif field.is_repeated:
            target = getattr(message, name)
            for item in value:
                if field.type == F.TYPE_MESSAGE:
                    _assign(target.add(), item)
                else:
                    target.append(item)
        elif field.type == F.TYPE_MESSAGE:
            getattr(message, name).SetInParent()
            _assign(getattr(message, name), value)
        else:
            setattr(message, name, value)


def messages(cls) -> st.SearchStrategy:
    """Instances of the generated message class ``cls``."""
    def build(values):
        message = cls()
        _assign(message, values)
        return message
    return message_dicts(cls.DESCRIPTOR).map(build)


def filled(cls, depth: int = 0):
    """A message of ``cls`` with every field set (repeated ones twice): the most bytes to cut."""
    message = cls()
    for field in cls.DESCRIPTOR.fields:
        if field.type == F.TYPE_MESSAGE and not _is_map(field) and depth >= 2:
            continue
        if _is_map(field):
            value_field = field.message_type.fields_by_name["value"]
            key = "k" if field.message_type.fields_by_name["key"].type == F.TYPE_STRING else 1
            target = getattr(message, field.name)
            if value_field.type == F.TYPE_MESSAGE:
                target[key].CopyFrom(filled(_class(value_field.message_type), depth + 1))
            else:
                target[key] = _sample(value_field)
        elif field.is_repeated:
            for _ in range(2):
                if field.type == F.TYPE_MESSAGE:
                    getattr(message, field.name).add().CopyFrom(
                        filled(_class(field.message_type), depth + 1))
                else:
                    getattr(message, field.name).append(_sample(field))
        elif field.type == F.TYPE_MESSAGE:
            getattr(message, field.name).CopyFrom(filled(_class(field.message_type), depth + 1))
        else:
            setattr(message, field.name, _sample(field))
    return message


def _class(descriptor):
    return GetMessageClass(descriptor)


def _sample(field):
    if field.type == F.TYPE_STRING:
        return "127.0.0.9" if _is_address(field) else "x-probe-1"
    if field.type == F.TYPE_BYTES:
        return b"\x80\x05probe"
    if field.type == F.TYPE_BOOL:
        return True
    if field.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return 1.5
    if field.type == F.TYPE_ENUM:
        return field.enum_type.values[-1].number
    return 7
