"""Model fields whose column type differs between PostgreSQL and SQLite."""

from __future__ import annotations

from typing import Any

import numpy as np
from django.db import models
from pgvector import Vector


class KeyField(models.CharField):
    """A string compared and ordered by code point on every database.

    PostgreSQL columns get the ``C`` collation, so ``ORDER BY`` and ``>=``/``<`` prefix
    ranges follow code points (what SQLite's default BINARY collation and Python do)
    rather than a locale that ignores punctuation and control characters.
    """

    def db_parameters(self, connection: Any) -> dict[str, Any]:
        params = super().db_parameters(connection)
        if connection.vendor == "postgresql" and not params.get("collation"):
            params["collation"] = "C"
        return params


class EmbeddingField(models.Field):
    """A float32 vector: pgvector's ``vector`` on PostgreSQL, a BLOB elsewhere.

    The column has no fixed dimension, so changing ``EMBEDDING_DIMENSIONS`` needs no
    migration of the app; the HNSW index casts to the configured dimension instead.
    """

    description = "Embedding vector"
    empty_strings_allowed = False

    def db_type(self, connection: Any) -> str:
        return "vector" if connection.vendor == "postgresql" else "blob"

    def get_db_prep_value(self, value: Any, connection: Any, prepared: bool = False) -> Any:
        if value is None:
            return None
        array = np.asarray(value, dtype=np.float32)
        if connection.vendor == "postgresql":
            return Vector._to_db(array)
        return array.tobytes()

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> np.ndarray | None:
        if value is None:
            return None
        if isinstance(value, (bytes, bytearray, memoryview)):
            return np.frombuffer(bytes(value), dtype=np.float32)
        return np.asarray(Vector._from_db(value), dtype=np.float32)

    def to_python(self, value: Any) -> Any:
        if value is None or isinstance(value, np.ndarray):
            return value
        if isinstance(value, (bytes, bytearray, memoryview)):
            return np.frombuffer(bytes(value), dtype=np.float32)
        if isinstance(value, str):
            return np.asarray(Vector._from_db(value), dtype=np.float32)
        return np.asarray(value, dtype=np.float32)

    def value_to_string(self, obj: Any) -> str:
        value = self.value_from_object(obj)
        return "" if value is None else Vector._to_db(np.asarray(value, dtype=np.float32)) or ""
