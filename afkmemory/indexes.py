"""Search indexes that differ per database, as migration operations read at migrate time.

PostgreSQL: an HNSW cosine index on ``embedding::vector(N)`` (N from
``EMBEDDING_DIMENSIONS``) and a GIN index on the memory's text search vector: since
migration 0008 a stored ``search_vector`` column (no model field: the column exists on
PostgreSQL only) that a trigger keeps equal to ``to_tsvector(config, search_text)``, before
it (and until 0009 has built the column's index) an index on that expression.
SQLite: an FTS5 table over ``search_text`` kept in step by triggers.

The dimension and text search configuration are settings, not part of the migration, so
a project changes them without editing the app's migrations: run
``manage.py afkmemory_rebuild_indexes`` after changing either (``rebuild_postgresql``, in
one transaction that locks the table, or ``rebuild_postgresql_concurrently``, online).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from django.db import migrations, transaction

from .conf import afk_settings
from .memory import types

MEMORY_TABLE = "afkmemory_longtermmemory"
HNSW_INDEX = "afkmemory_memory_embedding_hnsw"
GIN_INDEX = "afkmemory_memory_search_gin"  # on to_tsvector(config, search_text): until migration 0009
FTS_TABLE = "afkmemory_memory_fts"
#: The stored text search vector (PostgreSQL, migration 0008), its GIN index (0009), and the
#: trigger, and its function, that keep it equal to ``to_tsvector(config, search_text)``.
VECTOR_COLUMN = "search_vector"
VECTOR_GIN_INDEX = "afkmemory_memory_search_vector_gin"
VECTOR_TRIGGER = "afkmemory_memory_search_vector"


#: Memories ``refresh_search_text`` reads at a time (and rewrites, of those stale, in one transaction).
SEARCH_TEXT_BATCH = 100
#: A memory's columns in ``LongTermMemory``'s order: what its search text is made from, and
#: what the stores read to build the record.
MEMORY_FIELDS = ("memory_id", "user_id", "scope", "data", "text", "tags", "metadata", "created_at", "updated_at")


def refresh_search_text(
    memories: Any, batch_size: int = SEARCH_TEXT_BATCH, *, words: Callable[[str], list[str]] | None = None
) -> int:
    """Rewrite each memory's ``search_text`` that is not what ``search_document`` makes of it now
    (with ``words``, of its text split so: migration 0012's reverse puts the older words back).

    ``memories``: a queryset of the memory model (a migration's historical one too). Batch by
    batch in primary key order: a batch is read without locks, and only its stale rows are
    then locked, read again and written, in one transaction, so a table whose search text
    is mostly current is read, not rewritten (a lock is a write to the row on PostgreSQL).
    An upsert racing it either waits for the lock and then writes its own search text, or
    went first and is read again with its new text. Returns how many memories were rewritten.
    """
    alias = memories.db
    rows = memories.order_by("pk").only("pk", "search_text", *MEMORY_FIELDS)
    last, changed = 0, 0
    while True:
        batch = list(rows.filter(pk__gt=last)[:batch_size])
        stale = [row.pk for row in batch if _stale(row, words)]
        if stale:
            with transaction.atomic(using=alias):
                rewritten = [row for row in rows.select_for_update().filter(pk__in=stale) if _stale(row, words)]
                memories.bulk_update(rewritten, ["search_text"])
            changed += len(rewritten)
        if len(batch) < batch_size:
            return changed
        last = batch[-1].pk


def _stale(row: Any, words: Callable[[str], list[str]] | None) -> bool:
    """Whether ``row``'s search text is not what ``search_document`` makes of it now; if so, set it."""
    from .memory.text import search_document

    document = search_document(types.LongTermMemory(*(getattr(row, field) for field in MEMORY_FIELDS)), words)
    stale, row.search_text = row.search_text != document, document
    return stale


def text_search_config() -> str:
    """Return the configured PostgreSQL text search configuration, checked to be a plain name."""
    config = afk_settings.TEXT_SEARCH_CONFIG
    if not isinstance(config, str) or not re.fullmatch(r"[a-z_][a-z0-9_]*", config):
        raise ValueError(
            f"AFKMEMORY['TEXT_SEARCH_CONFIG'] must be a configuration name such as 'english', got {config!r}"
        )
    return config


def unknown_text_search_config(cursor: Any) -> str | None:
    """Why ``TEXT_SEARCH_CONFIG`` cannot be used in the PostgreSQL database of ``cursor``, or None if it can.

    The setting is checked to be a name, not to be one of the server's configurations: a
    misspelt one passed, and the trigger that stores the memories' text search vectors,
    once switched to it, failed every write to memories.
    """
    config = text_search_config()
    cursor.execute(
        "SELECT coalesce(bool_or(cfgname = %s), false), string_agg(cfgname, ', ' ORDER BY cfgname) "
        "FROM pg_ts_config WHERE pg_ts_config_is_visible(oid)",  # a name the search path finds
        [config],
    )
    found, known = cursor.fetchone()
    if found:
        return None
    return (
        f"AFKMEMORY['TEXT_SEARCH_CONFIG'] is {config!r}, a configuration the database does not have (it has: {known})"
    )


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


def stored_vector_sql(column: str) -> str:
    """Return the stored vector column of the row whose ``search_text`` column SQL is ``column``.

    ``column`` is the compiled ``search_text`` column (``"T"."search_text"``, ``U0."search_text"``
    in a subquery): the vector is named through the same table alias.
    """
    head, found, tail = column.rpartition('"search_text"')
    if not found or tail:
        raise ValueError(f"not a search_text column: {column!r}")
    return f'{head}"{VECTOR_COLUMN}"'


# -- The stored text search vector (PostgreSQL) ------------------------------------------------

#: How long DDL on the memory table waits for its lock before giving up and trying again.
#: ALTER TABLE waits for every open transaction that read the table, and every query that
#: comes after it waits behind it: bounded, a long transaction delays the migration instead
#: of stopping every reader and writer of memories.
DDL_LOCK_TIMEOUT_MS = 2000
#: Attempts at that lock, a growing pause between them (1 s, 2 s, ... 10 s): about 8 minutes
#: in all, the lock waits included.
DDL_LOCK_ATTEMPTS = 45

#: Memories, and bytes of search text, that one transaction of ``backfill_search_vectors``
#: fills: about 1 µs a byte (the vector's parse, and the expression index's of the row's new
#: version), so a batch holds its rows' locks for about a quarter of a second.
BACKFILL_ROWS = 500
BACKFILL_BYTES = 256 * 1024


def vector_function_sql() -> str:
    """Return the DDL of the trigger function: the vector of the configuration the trigger names."""
    return (
        f"CREATE OR REPLACE FUNCTION {VECTOR_TRIGGER}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"NEW.{VECTOR_COLUMN} := to_tsvector(TG_ARGV[0]::regconfig, NEW.search_text); RETURN NEW; END $$"
    )


def vector_trigger_sql() -> str:
    """Return the DDL of the trigger that fills the vector in the configured text search configuration.

    ``UPDATE OF search_text``: every writer, old code, ``bulk_update`` and raw SQL included,
    sets ``search_text`` when it changes it; an update of other columns keeps the vector.
    """
    return (
        f"CREATE OR REPLACE TRIGGER {VECTOR_TRIGGER} BEFORE INSERT OR UPDATE OF search_text ON {MEMORY_TABLE} "
        f"FOR EACH ROW EXECUTE FUNCTION {VECTOR_TRIGGER}('{text_search_config()}')"
    )


def has_vector_column(cursor: Any) -> bool:
    """Return whether the memory table has the stored vector column (migration 0008)."""
    cursor.execute(
        "SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = %s AND NOT attisdropped",
        [MEMORY_TABLE, VECTOR_COLUMN],
    )
    return cursor.fetchone() is not None


def trigger_config(cursor: Any) -> str | None:
    """Return the text search configuration the vector's trigger fills it in (None: no trigger)."""
    cursor.execute(
        "SELECT tgargs FROM pg_trigger WHERE tgrelid = to_regclass(%s) AND tgname = %s", [MEMORY_TABLE, VECTOR_TRIGGER]
    )
    row = cursor.fetchone()
    return _first_argument(row[0]) if row else None


def _first_argument(tgargs: Any) -> str:
    """A trigger's first argument, from ``pg_trigger.tgargs`` (its arguments, each ended by a NUL byte)."""
    return bytes(tgargs).split(b"\0")[0].decode()


def index_state(cursor: Any, name: str) -> str | None:
    """Return ``"valid"``, ``"invalid"`` (a concurrent build was interrupted) or None (no such index)."""
    cursor.execute("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", [name])
    row = cursor.fetchone()
    return None if row is None else ("valid" if row[0] else "invalid")


def create_index_concurrently(connection: Any, name: str, definition: str) -> None:
    """``CREATE INDEX CONCURRENTLY name definition``, outside a transaction, as 0006 builds its index.

    An index found valid was built by a migrate whose process was killed after sending the
    build (the server finished it): kept. One found invalid was interrupted on the server:
    dropped and built again.
    """
    with connection.cursor() as cursor:
        state = index_state(cursor, name)
        if state == "valid":
            return
        if state == "invalid":
            cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
        cursor.execute(f"CREATE INDEX CONCURRENTLY {name} ON {definition}")


def vector_index_definition() -> str:
    return f"{MEMORY_TABLE} USING gin ({VECTOR_COLUMN})"


def expression_index_definition() -> str:
    return f"{MEMORY_TABLE} USING gin ({tsvector_sql()})"


def run_with_lock_timeout(connection: Any, statements: list[str], attempts: int | None = None) -> None:
    """Run ``statements`` in one transaction, each lock waited for at most ``DDL_LOCK_TIMEOUT_MS``.

    Retried after a growing pause while another transaction holds the table; after
    ``attempts`` (``DDL_LOCK_ATTEMPTS``) the last lock timeout is raised.
    """
    from django.db import OperationalError

    attempts = DDL_LOCK_ATTEMPTS if attempts is None else attempts
    for attempt in range(1, attempts + 1):
        try:
            with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL lock_timeout = {int(DDL_LOCK_TIMEOUT_MS)}")
                for sql in statements:
                    cursor.execute(sql)
            return
        except OperationalError as exc:
            if getattr(exc.__cause__, "sqlstate", None) != "55P03" or attempt == attempts:  # lock_not_available
                raise
        time.sleep(min(attempt, 10))


def add_search_vector(connection: Any) -> None:
    """Add the vector column and its trigger: catalog changes only, in one short transaction.

    Together, so that no row is written between them with the column and without the
    trigger. The rows already there get their vectors from ``backfill_search_vectors``.
    Skipped where both are there (a migrate run again after it was killed): ALTER TABLE
    would wait for the table's lock even to find its column there. A column left by a
    killed migrate whose trigger is in another configuration (``TEXT_SEARCH_CONFIG``
    changed since) is dropped and added again, empty: the backfill, which fills only
    empty vectors, would have kept the old configuration's, and search would trust them.
    Dropping a column and adding a nullable one change the catalog only.
    """
    with connection.cursor() as cursor:
        present = has_vector_column(cursor)
        if present and trigger_config(cursor) == text_search_config():
            return
    stale = [f"ALTER TABLE {MEMORY_TABLE} DROP COLUMN {VECTOR_COLUMN}"] if present else []
    run_with_lock_timeout(
        connection,
        [
            vector_function_sql(),
            *stale,
            f"ALTER TABLE {MEMORY_TABLE} ADD COLUMN {VECTOR_COLUMN} tsvector",
            vector_trigger_sql(),
        ],
    )
    forget_search_vectors(connection.alias)


def remove_search_vector(connection: Any) -> None:
    """Drop the trigger, its function and the column (catalog changes only, as ``add_search_vector``)."""
    run_with_lock_timeout(
        connection,
        [
            f"DROP TRIGGER IF EXISTS {VECTOR_TRIGGER} ON {MEMORY_TABLE}",
            f"DROP FUNCTION IF EXISTS {VECTOR_TRIGGER}()",
            f"ALTER TABLE {MEMORY_TABLE} DROP COLUMN IF EXISTS {VECTOR_COLUMN}",
        ],
    )
    forget_search_vectors(connection.alias)


def backfill_search_vectors(
    connection: Any,
    batch_rows: int = BACKFILL_ROWS,
    batch_bytes: int = BACKFILL_BYTES,
    *,
    rewrite: bool = False,
    after_batch: Callable[[int], None] | None = None,
) -> int:
    """Fill the vector of every memory that has none, batch by batch in primary key order.

    Each batch is one transaction: up to ``batch_rows`` memories, and no more of them than
    fit ``batch_bytes`` of search text (at least one). A writer racing a batch waits for its
    row (or the batch for the writer's), and whichever comes second sees the other's row:
    the trigger fills a changed search text's vector, and the batch skips a row that has
    one by then. Returns how many memories were filled.

    ``rewrite``: every memory's vector, not only the empty ones, is set to the configured
    parse of its search text (``rebuild_postgresql_concurrently``, once the trigger fills
    the new configuration's vectors): the UPDATE computes it from the row's latest version
    once it holds its lock, so a writer racing a batch leaves the vector of its own text
    whichever comes second. ``after_batch(done)`` is called after each batch committed,
    with how many memories were filled or rewritten so far.
    """
    config = text_search_config()
    only_empty = "" if rewrite else f" AND {VECTOR_COLUMN} IS NULL"
    last, filled = 0, 0
    while True:
        with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
            # octet_length reads a TOASTed text's length from its header, without the text.
            cursor.execute(
                f"""
                SELECT max(id) FROM (
                    SELECT id, sum(octet_length(search_text)) OVER (ORDER BY id) - octet_length(search_text) AS before
                    FROM (SELECT id, search_text FROM {MEMORY_TABLE} WHERE id > %s ORDER BY id LIMIT %s) AS page
                ) AS batch WHERE before < %s
                """,
                [last, batch_rows, batch_bytes],
            )
            upto = cursor.fetchone()[0]
            if upto is None:
                return filled
            cursor.execute(
                f"UPDATE {MEMORY_TABLE} SET {VECTOR_COLUMN} = to_tsvector(%s::regconfig, search_text) "
                f"WHERE id > %s AND id <= %s{only_empty}",
                [config, last, upto],
            )
            filled += cursor.rowcount
        last = upto
        if after_batch is not None:
            after_batch(filled)


def rebuild_postgresql(cursor: Any) -> None:
    """Drop and create the HNSW and text search indexes, the trigger and every stored vector.

    In the caller's transaction, as ``afkmemory_rebuild_indexes`` runs it: readers see the old
    indexes or the new ones. The expression index of before 0009 is built again only where
    it was there; the stored vectors (since 0008) are all recomputed in the configured text
    search configuration, before their index is built. The indexes an interrupted
    ``rebuild_postgresql_concurrently`` left under a temporary name are dropped.
    """
    vectors = has_vector_column(cursor)
    expression = index_state(cursor, GIN_INDEX) is not None or not vectors
    leftovers = [
        f"DROP INDEX IF EXISTS {name}{suffix}"
        for name in (HNSW_INDEX, GIN_INDEX)
        for suffix in (NEW_SUFFIX, OLD_SUFFIX)
    ]
    for sql in drop_statements("postgresql") + [f"DROP INDEX IF EXISTS {VECTOR_GIN_INDEX}", *leftovers]:
        cursor.execute(sql)
    if vectors:
        cursor.execute(vector_function_sql())
        cursor.execute(vector_trigger_sql())
        cursor.execute(f"UPDATE {MEMORY_TABLE} SET {VECTOR_COLUMN} = {tsvector_sql()}")
    hnsw, gin = create_statements("postgresql")
    cursor.execute(hnsw)
    if expression:
        cursor.execute(gin)
    if vectors:
        cursor.execute(f"CREATE INDEX {VECTOR_GIN_INDEX} ON {vector_index_definition()}")


# -- Rebuilding online (PostgreSQL) ------------------------------------------------------------

#: What ``rebuild_index_concurrently`` builds an index as before it takes its name's place,
#: and what the index it replaces is called until it is dropped.
NEW_SUFFIX, OLD_SUFFIX = "_new", "_old"
#: Memories whose mismatched embeddings one transaction of ``clear_mismatched_embeddings`` clears.
CLEAR_BATCH = 1000
#: Seconds between ``rebuild_postgresql_concurrently``'s progress lines during its rewrite.
PROGRESS_SECONDS = 10.0


def drop_index_concurrently(connection: Any, name: str) -> None:
    """``DROP INDEX CONCURRENTLY IF EXISTS name`` (outside a transaction): writes and reads go on."""
    with connection.cursor() as cursor:
        cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")


def _index_definition(cursor: Any, name: str) -> tuple[str, list[str]] | None:
    """A valid index's ``pg_get_indexdef`` and storage options (``m=16``...), None if there is no valid one."""
    cursor.execute(
        "SELECT pg_get_indexdef(i.indexrelid), c.reloptions FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "WHERE i.indexrelid = to_regclass(%s) AND i.indisvalid",
        [name],
    )
    row = cursor.fetchone()
    return None if row is None else (row[0], list(row[1] or []))


def hnsw_index_current(cursor: Any, name: str) -> bool:
    """Whether ``name`` is a valid HNSW index as the settings make it: dimension, m, ef_construction."""
    found = _index_definition(cursor, name)
    if found is None:
        return False
    definition, options = found
    dims = embedding_dimensions()
    wanted = {f"m={int(afk_settings.HNSW_M)}", f"ef_construction={int(afk_settings.HNSW_EF_CONSTRUCTION)}"}
    return (
        "USING hnsw" in definition
        and f"::vector({dims})" in definition
        and f"vector_dims(embedding) = {dims})" in definition
        and wanted <= set(options)
    )


def expression_index_current(cursor: Any, name: str) -> bool:
    """Whether ``name`` is a valid GIN index on the configured ``tsvector_sql()`` (the index before 0009)."""
    found = _index_definition(cursor, name)
    return found is not None and f"to_tsvector('{text_search_config()}'::regconfig, search_text)" in found[0]


def rebuild_index_concurrently(
    connection: Any, name: str, definition: str, current: Callable[[Any, str], bool]
) -> None:
    """Build ``definition`` CONCURRENTLY as ``name`` + ``NEW_SUFFIX``, then put it in ``name``'s place.

    Writes go on during the build (and keep both indexes up to date). The swap renames the
    old index to ``name`` + ``OLD_SUFFIX`` and the new one to ``name`` in one short
    transaction: ALTER INDEX ... RENAME locks the index (SHARE UPDATE EXCLUSIVE), not the
    table, so reads, writes and their plans go on; a query sees one index or the other
    under ``name``, never none. The old one is then dropped CONCURRENTLY. A rerun after a
    kill finishes the job: a valid new index that ``current(cursor, its name)`` accepts is
    swapped in as it is; an invalid one (a build interrupted on the server), or one built
    from other settings, is dropped and built again; an old one left is dropped.
    """
    new, old = name + NEW_SUFFIX, name + OLD_SUFFIX
    with connection.cursor() as cursor:
        if index_state(cursor, new) == "valid" and not current(cursor, new):
            cursor.execute(f"DROP INDEX CONCURRENTLY {new}")
    create_index_concurrently(connection, new, definition)
    drop_index_concurrently(connection, old)  # left by a run killed after its swap: the name is needed
    run_with_lock_timeout(
        connection, [f"ALTER INDEX IF EXISTS {name} RENAME TO {old}", f"ALTER INDEX {new} RENAME TO {name}"]
    )
    drop_index_concurrently(connection, old)


def _rebuild_unless_current(
    connection: Any,
    name: str,
    definition: str,
    current: Callable[[Any, str], bool],
    log: Callable[[str], None],
    what: str,
    *,
    kept: str,
    building: str,
) -> None:
    """``rebuild_index_concurrently``, unless ``name`` is already as ``current`` wants it:
    then only the leftovers of a killed run (its ``_new`` and ``_old`` indexes) are dropped."""
    with connection.cursor() as cursor:
        done = current(cursor, name)
    if done:
        drop_index_concurrently(connection, name + NEW_SUFFIX)
        drop_index_concurrently(connection, name + OLD_SUFFIX)
        log(f"{what}: {kept}; kept.")
        return
    log(f"{what}: {building}...")
    rebuild_index_concurrently(connection, name, definition, current)
    log(f"{what}: built and swapped in.")


def mismatched_embedding_sql(vendor: str) -> str:
    """The condition that a memory's embedding is not ``EMBEDDING_DIMENSIONS`` long (a NULL one is not).

    Its components are float32: pgvector counts dimensions, SQLite stores 4 bytes each.
    """
    dims = embedding_dimensions()
    length, expected = ("vector_dims(embedding)", dims) if vendor == "postgresql" else ("length(embedding)", dims * 4)
    return f"embedding IS NOT NULL AND {length} <> {expected}"


def clear_mismatched_embeddings(connection: Any, batch_rows: int = CLEAR_BATCH) -> int:
    """Set every embedding that is not ``EMBEDDING_DIMENSIONS`` long to NULL, batch by batch in primary key order.

    Each batch is one short transaction, which locks only its rows. The UPDATE checks the
    length again on the row's latest version: a memory re-embedded at the configured
    dimension since the batch read it keeps its embedding. Returns how many were cleared.
    """
    mismatch = mismatched_embedding_sql("postgresql")
    last, cleared = 0, 0
    while True:
        with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
            cursor.execute(
                f"SELECT id FROM {MEMORY_TABLE} WHERE id > %s AND {mismatch} ORDER BY id LIMIT %s", [last, batch_rows]
            )
            ids = [row[0] for row in cursor.fetchall()]
            if not ids:
                return cleared
            cursor.execute(f"UPDATE {MEMORY_TABLE} SET embedding = NULL WHERE id = ANY(%s) AND {mismatch}", [ids])
            cleared += cursor.rowcount
        last = ids[-1]


def rebuild_postgresql_concurrently(
    connection: Any,
    log: Callable[[str], None] = lambda message: None,
    *,
    batch_rows: int = BACKFILL_ROWS,
    batch_bytes: int = BACKFILL_BYTES,
    after_batch: Callable[[int], None] | None = None,
) -> None:
    """``rebuild_postgresql`` online: no lock on the memory table longer than a catalog change.

    Outside a transaction (``CREATE INDEX CONCURRENTLY``), in steps that each leave search
    correct, only slower, and that a rerun after a kill takes up (``log`` is told each one):

    1. The HNSW index, unless it is already valid for the configured dimension, ``m`` and
       ``ef_construction``: ``rebuild_index_concurrently``. Meanwhile vector search reads
       the old index if it is of the configured dimension (a change of ``m`` only), else
       ranks exactly (``stores.memory``: an index of another dimension does not serve).
    2. The expression GIN index of before migration 0009, where there is one (or where
       there is no stored vector column, before 0008), unless it is already on the
       configured configuration: the same way. Search on the new configuration uses the
       new one as soon as it is built.
    3. The stored vectors (0008), unless the trigger fills them in the configured
       configuration and their GIN index is valid. Their index is dropped CONCURRENTLY
       first: ``stored_vectors`` is false without it, so search parses ``search_text`` in
       the configured configuration (correct, slowly) while the vectors are mixed. Where
       the vectors may have been searchable in another configuration (their index was
       valid, or is gone: a run killed after dropping it, perhaps a moment ago), the trigger
       switch waits ``SEARCH_VECTORS_TTL`` first: a process still on that configuration may
       have read them as searchable just before, and would miss memories whose vectors are
       rewritten.
       Then the trigger takes the configured configuration (one short transaction), every
       vector is rewritten (``backfill_search_vectors(rewrite=True)``, a transaction a
       batch: a memory written meanwhile gets its vector from the trigger, or from the
       batch, in the new configuration either way), and the index is built CONCURRENTLY:
       only once it is valid does ``stored_vectors`` trust the vectors again.

    ``after_batch(rewritten so far)`` is called after each batch of the rewrite committed.
    """
    alias, config = connection.alias, text_search_config()
    settings = (
        f"vector({embedding_dimensions()}), m={int(afk_settings.HNSW_M)}, "
        f"ef_construction={int(afk_settings.HNSW_EF_CONSTRUCTION)}"
    )
    _rebuild_unless_current(
        connection,
        HNSW_INDEX,
        hnsw_index_definition(),
        hnsw_index_current,
        log,
        "HNSW index",
        kept=f"already built for {settings}",
        building=f"building it for {settings} concurrently (vector search meanwhile: "
        "the old index if it is of this dimension, else an exact scan)",
    )
    with connection.cursor() as cursor:
        vectors = has_vector_column(cursor)
        expression = not vectors or index_state(cursor, GIN_INDEX) is not None
        filled_in = trigger_config(cursor) if vectors else None
        vector_index = index_state(cursor, VECTOR_GIN_INDEX) if vectors else None
    if expression:
        _rebuild_unless_current(
            connection,
            GIN_INDEX,
            expression_index_definition(),
            expression_index_current,
            log,
            "Text search expression index",
            kept=f"already on {config!r}",
            building=f"building it on {config!r} concurrently",
        )
    if not vectors:
        return
    if filled_in == config and vector_index == "valid":
        log(f"Stored text search vectors: in {config!r} and indexed; kept.")
        return
    if vector_index is not None:
        drop_index_concurrently(connection, VECTOR_GIN_INDEX)
        forget_search_vectors(alias)
        log(
            "Stored text search vectors: index dropped; text search parses each memory's text "
            f"in {config!r} until it is rebuilt."
        )
    if filled_in != config:
        if vector_index != "invalid":  # dropped just now, or by a run killed a moment ago
            log(f"Stored text search vectors: waiting {SEARCH_VECTORS_TTL:g} s for processes that searched them.")
            time.sleep(SEARCH_VECTORS_TTL)  # processes that read them as searchable a moment ago
        run_with_lock_timeout(connection, [vector_function_sql(), vector_trigger_sql()])
        log(f"Stored text search vectors: the trigger fills them in {config!r} now.")
    shown = [time.monotonic()]

    def progress(done: int) -> None:
        if time.monotonic() - shown[0] >= PROGRESS_SECONDS:
            shown[0] = time.monotonic()
            log(f"Stored text search vectors: {done} rewritten so far...")
        if after_batch is not None:
            after_batch(done)

    rewritten = backfill_search_vectors(connection, batch_rows, batch_bytes, rewrite=True, after_batch=progress)
    log(f"Stored text search vectors: rewrote {rewritten} in {config!r}; building their index concurrently...")
    create_index_concurrently(connection, VECTOR_GIN_INDEX, vector_index_definition())
    forget_search_vectors(alias)
    log("Stored text search vectors: indexed; text search reads them again.")


#: Seconds a process goes on with what it found of the stored vectors (``stored_vectors``).
SEARCH_VECTORS_TTL = 10.0

#: alias -> (when it was read, the configuration the stored vectors are in, None: not searchable).
_SEARCH_VECTORS: dict[str, tuple[float, str | None]] = {}

_SEARCH_VECTORS_SQL = f"""
    SELECT t.tgargs FROM pg_index i JOIN pg_trigger t ON t.tgrelid = i.indrelid
    WHERE i.indexrelid = to_regclass('{VECTOR_GIN_INDEX}') AND i.indisvalid AND i.indisready
      AND i.indrelid = to_regclass('{MEMORY_TABLE}') AND t.tgname = '{VECTOR_TRIGGER}' AND t.tgenabled <> 'D'
"""


def stored_vectors(using: str) -> bool:
    """Return whether text search on ``using`` (PostgreSQL) matches and ranks the stored vectors.

    They are searchable once their GIN index is valid (migration 0009 builds it after 0008
    filled every vector) and the trigger fills them in the configured ``TEXT_SEARCH_CONFIG``.
    Until then (code upgraded before ``migrate``, a migrate under way, the configuration
    changed and the indexes not rebuilt) search parses ``search_text`` as before. Read from
    the catalog at most every ``SEARCH_VECTORS_TTL`` seconds per process: a migrate's or a
    rebuild's result is taken up that long after it, without a restart.
    """
    known = _SEARCH_VECTORS.get(using)
    if known is None or time.monotonic() - known[0] >= SEARCH_VECTORS_TTL:
        from django.db import connections

        with connections[using].cursor() as cursor:
            cursor.execute(_SEARCH_VECTORS_SQL)
            row = cursor.fetchone()
        config = _first_argument(row[0]) if row else None
        known = _SEARCH_VECTORS[using] = (time.monotonic(), config)
    return known[1] is not None and known[1] == text_search_config()


def forget_search_vectors(using: str | None = None) -> None:
    """Make the next ``stored_vectors`` read the catalog again (after DDL in this process)."""
    if using is None:
        _SEARCH_VECTORS.clear()
    else:
        _SEARCH_VECTORS.pop(using, None)


def embedding_sql(column: str = "embedding") -> str:
    """Return the embedding expression the HNSW index is built on (queries must match it)."""
    return f"({column}::vector({embedding_dimensions()}))"


def dimension_predicate(column: str = "embedding") -> str:
    """Return the condition that an embedding has the configured dimension.

    The HNSW index is partial on it, so rows embedded before a change of dimension are
    left out of the index (and of searches) instead of breaking the index build.
    """
    return f"vector_dims({column}) = {embedding_dimensions()}"


def hnsw_index_definition() -> str:
    return (
        f"{MEMORY_TABLE} USING hnsw ({embedding_sql()} vector_cosine_ops) "
        f"WITH (m = {int(afk_settings.HNSW_M)}, ef_construction = {int(afk_settings.HNSW_EF_CONSTRUCTION)}) "
        f"WHERE {dimension_predicate()}"
    )


#: SQLite's FTS5 tokenizer: stemmed, diacritics folded, and words of letters, digits and
#: combining marks (``M*``, migration 0012), as ``memory.text`` splits them; before, a vowel
#: sign split a Devanagari word ("हिन्दी" into "ह न द").
FTS_TOKENIZER = "porter unicode61 remove_diacritics 2 categories 'L* N* Co M*'"


def create_statements(vendor: str, *, tokenizer: str = FTS_TOKENIZER) -> list[str]:
    """Return the DDL that creates the search indexes on ``vendor`` (SQLite's FTS5 table with ``tokenizer``)."""
    if vendor == "postgresql":
        return [
            f"CREATE INDEX IF NOT EXISTS {HNSW_INDEX} ON {hnsw_index_definition()}",
            f"CREATE INDEX IF NOT EXISTS {GIN_INDEX} ON {expression_index_definition()}",
        ]
    if vendor == "sqlite":
        quoted = tokenizer.replace("'", "''")
        return [
            f"CREATE VIRTUAL TABLE IF NOT EXISTS {FTS_TABLE} USING fts5(search_text, content='{MEMORY_TABLE}', "
            f"content_rowid='id', tokenize='{quoted}')",
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


class MemoryTableOperation(migrations.operations.base.Operation):
    """A migration operation on the memory table's database-specific parts, which no model
    state describes: it runs only on a database where the project's routers let the memory
    table migrate, as Django's own operations ask (elsewhere there is no table to change)."""

    reversible = True
    reduces_to_sql = False

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass

    def allowed(self, app_label: str, schema_editor: Any, state: Any) -> bool:
        model = state.apps.get_model(app_label, "LongTermMemory")
        return self.allow_migrate_model(schema_editor.connection.alias, model)


class CreateSearchIndexes(MemoryTableOperation):
    """Create the vendor's search indexes from the settings in force when it runs."""

    reduces_to_sql = True

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if self.allowed(app_label, schema_editor, to_state):
            for sql in create_statements(schema_editor.connection.vendor):
                schema_editor.execute(sql)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if self.allowed(app_label, schema_editor, from_state):
            for sql in drop_statements(schema_editor.connection.vendor):
                schema_editor.execute(sql)

    def describe(self) -> str:
        return "Create the database-specific search indexes of long-term memories"
