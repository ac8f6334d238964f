"""Serializer fields that accept exactly what the Python API accepts: its ``check_*`` functions decide.

DRF's own fields coerce (``CharField`` turns ``5`` into ``"5"`` and trims spaces,
``IntegerField`` takes ``"5"`` and ``5.0``, ``BooleanField`` takes ``"yes"``); the stores
refuse all of those. Each field here runs the store's check and turns its
``TypeError``/``ValueError`` into a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from .. import indexes
from ..conf import afk_settings
from ..memory.journal import check_run_id
from ..memory.types import (
    EVENT_TYPES,
    MAX_ID_BYTES,
    MAX_KEY_BYTES,
    check_count,
    check_id,
    check_json,
    check_memory_id,
    check_min_score,
    check_object,
    check_tags,
    dumps,
)
from ..namespaces import check_key, check_namespace

#: The largest integer the API takes: every JSON client (JavaScript included) holds it
#: exactly, and it fits the database's 64-bit columns.
MAX_INT = 2**53 - 1


def check_size(value: Any, name: str) -> Any:
    """Return ``value`` if its JSON encoding fits ``API_MAX_VALUE_BYTES``, else raise ``ValueError``."""
    limit = afk_settings.API_MAX_VALUE_BYTES
    size = len(dumps(value).encode("utf-8"))
    if limit is not None and size > limit:
        raise ValueError(f"{name} is {size} bytes as JSON; the limit is {limit} (AFKMEMORY['API_MAX_VALUE_BYTES'])")
    return value


class CheckedField(serializers.Field):
    """A field whose input is returned by a check function, or refused with that function's message."""

    def check(self, data: Any) -> Any:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def to_internal_value(self, data: Any) -> Any:
        try:
            return self.check(data)
        except (TypeError, ValueError, OverflowError) as exc:
            raise serializers.ValidationError(str(exc)) from exc

    def to_representation(self, value: Any) -> Any:
        return value

    def __deepcopy__(self, memo: Mapping[Any, Any]) -> Any:
        """Return an unbound copy, as DRF's ``Field.__deepcopy__`` does, without re-running ``__init__``.

        Every serializer instance deep-copies its declared fields; DRF does it by calling
        ``__init__`` again with deep copies of the arguments, which (merging the error
        messages of the whole class hierarchy) was the largest cost of validating an
        event. The arguments of these fields are immutable (numbers, strings, callables),
        so a copy of the unbound field's attributes is the same field; its dicts and lists
        are copied, so no instance shares them. A bound field (its name, label and source
        set by ``bind()``) is copied DRF's way.
        """
        if self.parent is not None or self.field_name is not None:
            return super().__deepcopy__(memo)
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.error_messages = dict(self.error_messages)
        clone.style = dict(self.style)
        if "_validators" in self.__dict__:
            clone._validators = list(self._validators)
        return clone

    @property
    def name(self) -> str:
        return self.field_name or "value"


#: A string without NUL, which no database the API stores in can compare (``check_text``).
NO_NUL = r"^[^\x00]*$"


def utf8_string(max_bytes: int, *, min_length: int = 1, pattern: str = NO_NUL) -> dict[str, Any]:
    """The schema of a string without NUL the server limits to ``max_bytes`` of UTF-8.

    JSON Schema's ``maxLength`` counts characters, so it is the limit only for one-byte
    characters (200 "é" fit it and are a 400); ``x-max-bytes`` states the server's own.
    """
    return {
        "type": "string", "minLength": min_length, "maxLength": max_bytes, "x-max-bytes": max_bytes, "pattern": pattern,
    }  # fmt: skip


@extend_schema_field(utf8_string(MAX_ID_BYTES))
class IdField(CheckedField):
    """An identifier: a non-empty string without NUL, at most 255 bytes in UTF-8."""

    max_bytes = MAX_ID_BYTES

    def check(self, data: Any) -> str:
        return check_id(data, self.name, max_bytes=self.max_bytes)


class MemoryIdField(IdField):
    """The id of a memory the API writes: one its URL can name (``check_memory_id``)."""

    def check(self, data: Any) -> str:
        return check_memory_id(data, self.name)


@extend_schema_field(utf8_string(MAX_KEY_BYTES))
class StateKeyField(IdField):
    """A state key: like an id, up to 1024 bytes."""

    max_bytes = MAX_KEY_BYTES


#: A run id: an id without ``:`` (``check_run_id``).
RUN_ID_SCHEMA = utf8_string(MAX_ID_BYTES, pattern=r"^[^:\x00]*$")


@extend_schema_field(RUN_ID_SCHEMA)
class RunIdField(CheckedField):
    """A run id: an id without ``:``, which AFK's state keys are split on."""

    def check(self, data: Any) -> str:
        return check_run_id(data)


@extend_schema_field(utf8_string(MAX_KEY_BYTES, min_length=0))
class StoreKeyField(CheckedField):
    """A store item key (agentflow's rules: any string without NUL up to 1024 bytes)."""

    def check(self, data: Any) -> str:
        return check_key(data, self.name)


@extend_schema_field({"type": "string", "enum": sorted(EVENT_TYPES)})
class EventTypeField(CheckedField):
    def check(self, data: Any) -> str:
        if not isinstance(data, str) or data not in EVENT_TYPES:
            raise ValueError(f"{data!r} is not an event type; use one of {sorted(EVENT_TYPES)}")
        return data


@extend_schema_field(OpenApiTypes.ANY)
class JSONValueField(CheckedField):
    """Any JSON value (null included when ``allow_null``), up to ``API_MAX_VALUE_BYTES``."""

    def check(self, data: Any) -> Any:
        return check_size(check_json(data, self.name), self.name)


@extend_schema_field({"type": "object", "additionalProperties": {}})
class JSONObjectField(CheckedField):
    """A JSON object, up to ``API_MAX_VALUE_BYTES``."""

    def check(self, data: Any) -> dict[str, Any]:
        return check_size(check_object(data, self.name), self.name)


@extend_schema_field({"type": "array", "items": {"type": "string", "pattern": NO_NUL}})
class TagsField(CheckedField):
    def check(self, data: Any) -> list[str]:
        return check_size(check_tags(data, self.name), self.name)


@extend_schema_field({"type": "string", "nullable": True, "pattern": NO_NUL})
class TextField(CheckedField):
    """Free text (a memory's ``text``, a search ``query``): a string without NUL."""

    def __init__(self, *, max_length: int | None = None, **kwargs: Any) -> None:
        self.max_length = max_length
        super().__init__(**kwargs)

    def check(self, data: Any) -> str:
        if not isinstance(data, str):
            raise TypeError(f"{self.name} must be a string, got {type(data).__name__}")
        if self.max_length is not None and len(data) > self.max_length:
            raise ValueError(f"{self.name} has {len(data)} characters; the limit is {self.max_length}")
        return check_size(check_json(data, self.name), self.name)


class CountField(CheckedField):
    """A whole number (not a string, float or boolean) between ``minimum`` and ``maximum`` (schema: ``schema.py``)."""

    def __init__(self, *, minimum: int = 0, maximum: int | Callable[[], int] = MAX_INT, **kwargs: Any) -> None:
        self.minimum = minimum
        self._maximum = maximum
        super().__init__(**kwargs)

    @property
    def maximum(self) -> int:
        return self._maximum() if callable(self._maximum) else self._maximum

    def check(self, data: Any) -> int:
        value = check_count(data, self.name, minimum=self.minimum)
        if value > self.maximum:
            raise ValueError(f"{self.name} must be <= {self.maximum}, got {value}")
        return value


def max_page_size() -> int:
    """Return the largest page the API serves (``AFKMEMORY['API_MAX_PAGE_SIZE']``)."""
    return int(afk_settings.API_MAX_PAGE_SIZE)


class LimitField(CountField):
    """A page size: 0 to ``API_MAX_PAGE_SIZE``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(maximum=max_page_size, **kwargs)


@extend_schema_field({"type": "number"})
class ScoreField(CheckedField):
    def check(self, data: Any) -> float | None:
        return check_min_score(data)


@extend_schema_field({"type": "number", "minimum": 0, "nullable": True})
class TTLField(CheckedField):
    """Seconds an item lives; the store refuses negative and non-finite numbers."""

    def check(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise TypeError(f"{self.name} must be a number of seconds, got {type(data).__name__}")
        return data


@extend_schema_field({"type": "boolean"})
class StrictBooleanField(CheckedField):
    """``true`` or ``false``, nothing that merely looks like one."""

    def check(self, data: Any) -> bool:
        if not isinstance(data, bool):
            raise TypeError(f"{self.name} must be true or false, got {type(data).__name__}")
        return data


class EmbeddingField(CheckedField):
    """A vector of ``EMBEDDING_DIMENSIONS`` numbers that has a length in float32 (``check_embedding``)."""

    def check(self, data: Any) -> list[float]:
        if not isinstance(data, list):
            raise TypeError(f"{self.name} must be an array of numbers, got {type(data).__name__}")
        return indexes.check_embedding(data, self.name)


class NamespaceField(CheckedField):
    """A store namespace as a JSON array of non-empty strings (``allow_empty``: ``[]`` too)."""

    def __init__(self, *, allow_empty: bool = False, **kwargs: Any) -> None:
        self.allow_empty = allow_empty
        super().__init__(**kwargs)

    def check(self, data: Any) -> tuple[str, ...]:
        if not isinstance(data, list):
            raise TypeError(f'{self.name} must be an array of strings such as ["users", "u1"]')
        return check_namespace(tuple(data), self.name, allow_empty=self.allow_empty)

    def to_representation(self, value: Any) -> list[str]:
        return list(value)
