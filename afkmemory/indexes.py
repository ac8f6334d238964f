"""Search indexes that differ per database, as migration operations read at migrate time.

PostgreSQL: an HNSW cosine index on ``embedding::vector(N)`` (N from
``EMBEDDING_DIMENSIONS``) and a GIN index on the memory's text search vector.
SQLite: an FTS5 table over ``search_text`` kept in step by triggers.

The dimension and text search configuration are settings, not part of the migration, so
a project changes them without editing the app's migrations: run
``manage.py afkmemory_rebuild_indexes`` after changing either.
"""

from __future__ import annotations

import re
from typing import Any

from django.db import migrations, transaction

from .conf import afk_settings
from .memory import types

MEMORY_TABLE = "afkmemory_longtermmemory"
HNSW_INDEX = "afkmemory_memory_embedding_hnsw"
GIN_INDEX = "afkmemory_memory_search_gin"
FTS_TABLE = "afkmemory_memory_fts"


#: Memories whose search text one transaction of ``refresh_search_text`` rewrites.
SEARCH_TEXT_BATCH = 100
#: A memory's columns in ``LongTermMemory``'s order: what its search text is made from, and
#: what the stores read to build the record.
MEMORY_FIELDS = ("memory_id", "user_id", "scope", "data", "text", "tags", "metadata", "created_at", "updated_at")


def refresh_search_text(memories: Any, batch_size: int = SEARCH_TEXT_BATCH) -> int:
    """Rewrite each memory's ``search_text`` that is not what ``search_document`` makes of it now.

    ``memories``: a queryset of the memory model (a migration's historical one too). Batch by
    batch in primary key order, each batch one transaction that locks its rows, reads and
    writes them: an upsert racing it either waits for the batch and then writes its own
    search text, or went first and is read with its new text. (Read outside the lock, a
    memory updated in between kept the search text of its old text.) Returns how many
    memories were rewritten.
    """
    from .memory.text import search_document

    alias = memories.db
    last, changed = 0, 0
    while True:
        with transaction.atomic(using=alias):
            batch = list(
                memories.select_for_update()
                .filter(pk__gt=last)
                .order_by("pk")
                .only("pk", "search_text", *MEMORY_FIELDS)[:batch_size]
            )
            stale = []
            for row in batch:
                document = search_document(types.LongTermMemory(*(getattr(row, field) for field in MEMORY_FIELDS)))
                if row.search_text != document:
                    row.search_text = document
                    stale.append(row)
            if stale:
                memories.bulk_update(stale, ["search_text"])
        changed += len(stale)
        if len(batch) < batch_size:
            return changed
        last = batch[-1].pk


def text_search_config() -> str:
    """Return the configured PostgreSQL text search configuration, checked to be a plain name."""
    config = afk_settings.TEXT_SEARCH_CONFIG
    if not isinstance(config, str) or not re.fullmatch(r"[a-z_][a-z0-9_]*", config):
        raise ValueError(
            f"AFKMEMORY['TEXT_SEARCH_CONFIG'] must be a configuration name such as 'english', got {config!r}"
        )
    return config


#: Where the Django stores' embedding length is set.
DIMENSIONS_SETTING = "AFKMEMORY['EMBEDDING_DIMENSIONS']"


def embedding_dimensions() -> int:
    """Return the configured embedding dimension, checked to be one pgvector can index."""
    dims = afk_settings.EMBEDDING_DIMENSIONS
    if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= 2000:
        raise ValueError(
            f"{DIMENSIONS_SETTING} must be an integer from 1 to 2000 (pgvector's HNSW limit), got {dims!r}"
        )
    return dims


def check_embedding(value: Any, name: str) -> list[float]:
    """Return ``value`` as a list of floats of the configured length (``EMBEDDING_DIMENSIONS``), else raise."""
    return types.check_embedding(value, name, embedding_dimensions(), DIMENSIONS_SETTING)


def tsvector_sql(column: str = "search_text") -> str:
    """Return the text search vector expression the GIN index is built on (queries must match it)."""
    return f"to_tsvector('{text_search_config()}'::regconfig, {column})"


def embedding_sql(column: str = "embedding") -> str:
    """Return the embedding expression the HNSW index is built on (queries must match it)."""
    return f"({column}::vector({embedding_dimensions()}))"


def dimension_predicate(column: str = "embedding") -> str:
    """Return the condition that an embedding has the configured dimension.

    The HNSW index is partial on it, so rows embedded before a change of dimension are
    left out of the index (and of searches) instead of breaking the index build.
    """
    return f"vector_dims({column}) = {embedding_dimensions()}"


def create_statements(vendor: str) -> list[str]:
    """Return the DDL that creates the search indexes on ``vendor``."""
    if vendor == "postgresql":
        return [
            f"CREATE INDEX IF NOT EXISTS {HNSW_INDEX} ON {MEMORY_TABLE} USING hnsw "
            f"({embedding_sql()} vector_cosine_ops) "
            f"WITH (m = {int(afk_settings.HNSW_M)}, ef_construction = {int(afk_settings.HNSW_EF_CONSTRUCTION)}) "
            f"WHERE {dimension_predicate()}",
            f"CREATE INDEX IF NOT EXISTS {GIN_INDEX} ON {MEMORY_TABLE} USING gin ({tsvector_sql()})",
        ]
    if vendor == "sqlite":
        return [
            f"CREATE VIRTUAL TABLE IF NOT EXISTS {FTS_TABLE} USING fts5(search_text, content='{MEMORY_TABLE}', "
            "content_rowid='id', tokenize='porter unicode61 remove_diacritics 2')",
            f"CREATE TRIGGER IF NOT EXISTS {FTS_TABLE}_ai AFTER INSERT ON {MEMORY_TABLE} BEGIN "
            f"INSERT INTO {FTS_TABLE}(rowid, search_text) VALUES (new.id, new.search_text); END",
            f"CREATE TRIGGER IF NOT EXISTS {FTS_TABLE}_ad AFTER DELETE ON {MEMORY_TABLE} BEGIN "
            f"INSERT INTO {FTS_TABLE}({FTS_TABLE}, rowid, search_text) VALUES ('delete', old.id, old.search_text); END",
            f"CREATE TRIGGER IF NOT EXISTS {FTS_TABLE}_au AFTER UPDATE OF search_text ON {MEMORY_TABLE} BEGIN "
            f"INSERT INTO {FTS_TABLE}({FTS_TABLE}, rowid, search_text) VALUES ('delete', old.id, old.search_text); "
            f"INSERT INTO {FTS_TABLE}(rowid, search_text) VALUES (new.id, new.search_text); END",
            f"INSERT INTO {FTS_TABLE}({FTS_TABLE}) VALUES ('rebuild')",
        ]
    return []


def drop_statements(vendor: str) -> list[str]:
    """Return the DDL that removes the search indexes on ``vendor``."""
    if vendor == "postgresql":
        return [f"DROP INDEX IF EXISTS {HNSW_INDEX}", f"DROP INDEX IF EXISTS {GIN_INDEX}"]
    if vendor == "sqlite":
        return [f"DROP TRIGGER IF EXISTS {FTS_TABLE}_{t}" for t in ("ai", "ad", "au")] + [
            f"DROP TABLE IF EXISTS {FTS_TABLE}"
        ]
    return []


class CreateSearchIndexes(migrations.operations.base.Operation):
    """Create the vendor's search indexes from the settings in force when it runs."""

    reversible = True
    reduces_to_sql = True

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if self._allowed(app_label, schema_editor, to_state):
            for sql in create_statements(schema_editor.connection.vendor):
                schema_editor.execute(sql)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if self._allowed(app_label, schema_editor, from_state):
            for sql in drop_statements(schema_editor.connection.vendor):
                schema_editor.execute(sql)

    def _allowed(self, app_label: str, schema_editor: Any, state: Any) -> bool:
        """Whether the project's routers let the memory table migrate on this database, as
        Django's own operations ask (a database without afkmemory's tables has nothing to index)."""
        model = state.apps.get_model(app_label, "LongTermMemory")
        return self.allow_migrate_model(schema_editor.connection.alias, model)

    def describe(self) -> str:
        return "Create the database-specific search indexes of long-term memories"
