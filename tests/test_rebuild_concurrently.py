"""``afkmemory_rebuild_indexes --concurrently``: the PostgreSQL rebuild that does not lock the memory table.

The plain command is one transaction whose ``DROP INDEX`` holds the table's ACCESS EXCLUSIVE
lock until every stored text search vector is rewritten and the indexes are built (84 s for
100,000 memories): every read and write of memories waits. ``--concurrently`` builds the
indexes with ``CREATE INDEX CONCURRENTLY``, swaps them in by renaming, and rewrites the
vectors a short transaction a batch, search staying correct meanwhile. These tests run
outside a transaction (``CREATE INDEX CONCURRENTLY`` cannot run in one), with other
connections writing while the rebuild runs, and put the schema back as migrated after each.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from io import StringIO
from typing import Any

import numpy as np
import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connections
from django.test import override_settings

from afkmemory import checks, indexes
from afkmemory.memory import LongTermMemory
from afkmemory.stores import SyncDjangoMemoryStore
from afkmemory.stores import memory as memory_module
from tests.test_search_vector import _load, _old_schema, _out_of_step, _sql, _statement_of_search
from tests.test_vector_search_postgres import _ranked_by, _search, hnsw_path_by_default
from tests.utils import FLUSHED_APPS

pytestmark = pytest.mark.django_db(databases=["postgres"], transaction=True, available_apps=FLUSHED_APPS)

TABLE = indexes.MEMORY_TABLE
SIMPLE = {"EMBEDDING_DIMENSIONS": 8, "TEXT_SEARCH_CONFIG": "simple"}
#: Seconds a test waits for the other thread to get somewhere before it fails.
PATIENCE = 60
#: How long this test's own statements wait for a lock (the rebuild under test must not make them wait).
LOCK_TIMEOUT = "10s"


@pytest.fixture(autouse=True)
def _schema_as_migrated(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No wait for other processes' view of the stored vectors (none here); the schema as migrated afterwards."""
    monkeypatch.setattr(indexes, "SEARCH_VECTORS_TTL", 0.0)
    postgres = "postgres" in request.node.get_closest_marker("django_db").kwargs["databases"]
    if postgres:
        _sql(f"SET lock_timeout = '{LOCK_TIMEOUT}'")  # a test whose rebuild blocks fails instead of hanging
    yield
    if not postgres:
        return
    _sql("RESET lock_timeout")
    connection = connections["postgres"]
    with connection.cursor() as cursor:
        if not indexes.has_vector_column(cursor):
            indexes.add_search_vector(connection)
            indexes.backfill_search_vectors(connection)
    indexes.rebuild_postgresql_concurrently(connection)
    for name in (indexes.GIN_INDEX, indexes.VECTOR_GIN_INDEX, indexes.HNSW_INDEX):
        for leftover in (name + indexes.NEW_SUFFIX, name + indexes.OLD_SUFFIX):
            indexes.drop_index_concurrently(connection, leftover)
    indexes.drop_index_concurrently(connection, indexes.GIN_INDEX)  # 0009 dropped it
    indexes.forget_search_vectors()
    memory_module._TABLE_ROWS.clear()


def _rebuild(**settings: Any) -> str:
    out = StringIO()
    call_command("afkmemory_rebuild_indexes", database="postgres", concurrently=True, stdout=out, **settings)
    return out.getvalue()


def _other_connection() -> psycopg.Connection:
    """A connection of its own (autocommit), as another process of the project has."""
    connection = connections["postgres"]
    other = connection.get_new_connection(connection.get_connection_params())
    other.autocommit = True
    other.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
    return other


def _insert_without_waiting(other: psycopg.Connection, memory_id: str, text: str, embedding: str | None = None) -> None:
    """INSERT a memory, giving up after 200 ms waiting for a lock (raises ``psycopg.errors.LockNotAvailable``)."""
    with other.transaction():
        other.execute("SET LOCAL lock_timeout = '200ms'")
        other.execute(
            f"INSERT INTO {TABLE} (memory_id, user_id, scope, data, text, tags, metadata, created_at, updated_at, "
            "search_text, embedding) VALUES (%s, 'u', 'global', '{}', %s, '[]', '{}', 100, 100, lower(%s), %s)",
            [memory_id, text, text, embedding],
        )


def _index_oid(name: str) -> int | None:
    return _sql("SELECT to_regclass(%s)::oid", [name])[0][0]


def _hnsw_definition() -> str:
    return _sql("SELECT pg_get_indexdef(to_regclass(%s))", [indexes.HNSW_INDEX])[0][0]


def _leftovers() -> list[str]:
    """The temporary indexes of a rebuild still there."""
    return [
        row[0]
        for row in _sql(
            "SELECT indexname FROM pg_indexes WHERE tablename = %s AND (indexname LIKE %s OR indexname LIKE %s)",
            [TABLE, "%" + indexes.NEW_SUFFIX, "%" + indexes.OLD_SUFFIX],
        )
    ]


def _interrupted_build(name: str, definition: str) -> None:
    """Leave ``name`` INVALID, as a ``CREATE INDEX CONCURRENTLY`` cancelled (or killed) on the server does.

    A transaction holding the table's ROW EXCLUSIVE lock (a writer's) keeps the build waiting
    after it committed the index's catalog entry; a statement timeout then cancels it.
    """
    holder, builder = _other_connection(), _other_connection()
    with holder, builder:
        holder.autocommit = False
        holder.execute(f"LOCK TABLE {TABLE} IN ROW EXCLUSIVE MODE")
        builder.execute("SET statement_timeout = '300ms'")
        with pytest.raises(psycopg.errors.QueryCanceled):
            builder.execute(f"CREATE INDEX CONCURRENTLY {name} ON {definition}")
        holder.rollback()
    with connections["postgres"].cursor() as cursor:
        assert indexes.index_state(cursor, name) == "invalid"


def _wait_until(sql: str, params: list[Any]) -> None:
    """Until ``sql`` returns a row: what another thread's statement waits for, read from the server."""
    deadline = time.monotonic() + PATIENCE
    while not _sql(sql, params):
        assert time.monotonic() < deadline, sql
        time.sleep(0.02)


def _wait_for_index_build_waiting() -> None:
    """Until a ``CREATE INDEX CONCURRENTLY`` on the memory table is under way (here: waiting for a writer)."""
    _wait_until("SELECT 1 FROM pg_stat_progress_create_index WHERE relid = %s::regclass", [TABLE])


def _in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``target`` in a thread with Django connections of its own; its exception is kept in the list."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # re-raised by the test
            failures.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, failures


def _embeddings(count: int, dims: int, seed: int = 7) -> list[list[float]]:
    return np.random.default_rng(seed).normal(size=(count, dims)).astype(np.float32).tolist()


def test_a_dimension_change_builds_the_hnsw_index_online_and_vector_search_reads_it(monkeypatch):
    store = SyncDjangoMemoryStore(using="postgres")
    store.upsert_long_term_memory(LongTermMemory("old", "u"), embedding=[1.0] * 8)
    hnsw_path_by_default(monkeypatch)  # HNSW_TUPLE_COST 0: the index serves 300 memories
    with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": 16, "EXACT_SEARCH_THRESHOLD": 10}):
        out = _rebuild(clear_mismatched_embeddings=True)
        assert "Cleared 1 mismatched embeddings." in out and "HNSW index: built and swapped in." in out
        with connections["postgres"].cursor() as cursor:
            assert indexes.hnsw_index_current(cursor, indexes.HNSW_INDEX)
        assert "vector(16)" in _hnsw_definition() and _leftovers() == []
        assert _sql(f"SELECT count(*) FROM {TABLE} WHERE embedding IS NOT NULL") == [(0,)]
        assert checks.check_search_indexes(databases=["postgres"]) == []

        vectors = _embeddings(300, 16)
        for i, vector in enumerate(vectors):
            store.upsert_long_term_memory(LongTermMemory(f"m{i}", "u"), embedding=vector)
        _sql(f"ANALYZE {TABLE}")
        memory_module._TABLE_ROWS.clear()
        hits, search_sql = _search(store, np.array(vectors[42]), 5, user="u")
        assert hits[0][0].id == "m42" and hits[0][1] == pytest.approx(1.0, abs=1e-5)
        assert _ranked_by(search_sql) == ("hnsw", {indexes.HNSW_INDEX})

        built = _index_oid(indexes.HNSW_INDEX)
        assert "HNSW index: already built for vector(16)" in _rebuild()  # nothing changed: kept
        assert _index_oid(indexes.HNSW_INDEX) == built
        with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": 16, "HNSW_M": 24}):
            assert "HNSW index: built and swapped in." in _rebuild()
        assert "m='24'" in _hnsw_definition() and _index_oid(indexes.HNSW_INDEX) != built


def test_a_text_search_config_change_rewrites_every_vector_and_the_trigger():
    store = SyncDjangoMemoryStore(using="postgres")
    store.upsert_long_term_memory(LongTermMemory("m", "u", text="The cats are sleeping", updated_at=1))
    _load(30, "bulk", "Running dogs")
    with override_settings(AFKMEMORY=SIMPLE):
        out = _rebuild()
        assert "the trigger fills them in 'simple' now" in out and "rewrote 31 in 'simple'" in out
        with connections["postgres"].cursor() as cursor:
            assert indexes.trigger_config(cursor) == "simple"
            assert indexes.index_state(cursor, indexes.VECTOR_GIN_INDEX) == "valid"
            assert indexes.index_state(cursor, indexes.GIN_INDEX) is None
        assert _out_of_step() == [] and indexes.stored_vectors("postgres")
        sql, found = _statement_of_search(store, "u", "the")  # a stop word in 'english'
        assert "search_vector" in sql and found == ["m"]
        assert [m.id for m in store.search_long_term_memory_text("u", "cats")] == ["m"]
        assert store.search_long_term_memory_text("u", "cat") == []  # no stemming in 'simple'
        assert len(store.search_long_term_memory_text("bulk", "running", limit=50)) == 30
        assert store.search_long_term_memory_text("bulk", "run") == []
        store.upsert_long_term_memory(LongTermMemory("n", "u", text="the cat", updated_at=2))
        assert _out_of_step() == []  # the trigger writes 'simple' vectors
        assert "in 'simple' and indexed; kept" in _rebuild()
    assert not indexes.stored_vectors("postgres")  # back to 'english': search parses the text meanwhile
    assert "rewrote 32 in 'english'" in _rebuild()
    assert _out_of_step() == [] and indexes.stored_vectors("postgres")
    assert [m.id for m in store.search_long_term_memory_text("u", "cat")] == ["n", "m"]
    assert len(store.search_long_term_memory_text("bulk", "run", limit=50)) == 30


def test_writes_racing_the_batch_rewrite_end_with_the_new_configurations_vectors():
    _load(10, "u", "Walking dogs")
    ids = [row[0] for row in _sql(f"SELECT id FROM {TABLE} ORDER BY id")]
    calls: list[int] = []

    def between_batches(done: int) -> None:
        calls.append(done)
        if len(calls) == 3:  # rows 1-3 rewritten, 4-10 not yet
            with _other_connection() as other:
                other.execute(f"UPDATE {TABLE} SET search_text = 'the cats sat' WHERE id = %s", [ids[0]])
                other.execute(f"UPDATE {TABLE} SET search_text = 'the mice ran' WHERE id = %s", [ids[8]])
                _insert_without_waiting(other, "new", "The birds sang")

    with override_settings(AFKMEMORY=SIMPLE):
        indexes.rebuild_postgresql_concurrently(connections["postgres"], batch_rows=1, after_batch=between_batches)
        assert len(calls) == 11  # a batch a row: the ten, and the one inserted meanwhile
        assert _out_of_step() == []
        store = SyncDjangoMemoryStore(using="postgres")
        assert indexes.stored_vectors("postgres")
        assert [m.id for m in store.search_long_term_memory_text("u", "cats")] == ["u-0"]
        assert [m.id for m in store.search_long_term_memory_text("u", "mice")] == ["u-8"]
        assert [m.id for m in store.search_long_term_memory_text("u", "birds")] == ["new"]
        assert store.search_long_term_memory_text("u", "bird") == []


def test_inserts_do_not_wait_for_the_rewrite_or_the_text_index_build():
    """The key property: another connection writes throughout, with a 200 ms lock timeout,
    and text search finds the right memories while the vectors are half rewritten."""
    _load(6, "u", "The cats are sleeping")
    store = SyncDjangoMemoryStore(using="postgres")
    rewriting, resume = threading.Event(), threading.Event()
    holder = _other_connection()

    def between_batches(done: int) -> None:
        if done == 2:  # two of six rewritten
            rewriting.set()
            assert resume.wait(PATIENCE)
            holder.autocommit = False  # a writer's open transaction: the index build waits for it
            holder.execute(f"LOCK TABLE {TABLE} IN ROW EXCLUSIVE MODE")

    with override_settings(AFKMEMORY=SIMPLE), holder, _other_connection() as other:
        thread, failures = _in_thread(
            lambda: indexes.rebuild_postgresql_concurrently(
                connections["postgres"], batch_rows=1, after_batch=between_batches
            )
        )
        try:
            assert rewriting.wait(PATIENCE)
            _insert_without_waiting(other, "during-rewrite", "The cats woke up")
            # Mixed vectors, their index dropped: search parses the text in 'simple'.
            assert not indexes.stored_vectors("postgres")
            assert len(store.search_long_term_memory_text("u", "cats")) == 7
            assert store.search_long_term_memory_text("u", "cat") == []
            assert len(store.search_long_term_memory_text("u", "the")) == 7
            resume.set()
            _wait_for_index_build_waiting()
            _insert_without_waiting(other, "during-build", "The cats ate")
            assert not indexes.stored_vectors("postgres")
            assert len(store.search_long_term_memory_text("u", "cats")) == 8
        finally:
            resume.set()
            holder.rollback()
            thread.join(PATIENCE)
        assert not thread.is_alive() and not failures, failures
        assert _out_of_step() == [] and indexes.stored_vectors("postgres")
        assert len(store.search_long_term_memory_text("u", "cats")) == 8
        assert store.search_long_term_memory_text("u", "cat") == []


def test_inserts_do_not_wait_for_the_hnsw_build():
    store = SyncDjangoMemoryStore(using="postgres")
    vectors = _embeddings(3, 16)
    holder = _other_connection()
    with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": 16}), holder, _other_connection() as other:
        holder.autocommit = False
        holder.execute(f"LOCK TABLE {TABLE} IN ROW EXCLUSIVE MODE")  # a writer's open transaction
        thread, failures = _in_thread(_rebuild)
        try:
            _wait_for_index_build_waiting()
            _insert_without_waiting(other, "during-build", "first", str(vectors[0]))
            # The old index is for 8 dimensions: vector search ranks exactly meanwhile.
            assert [m.id for m, _ in store.search_long_term_memory_vector("u", vectors[0], limit=1)] == ["during-build"]
        finally:
            holder.rollback()
            thread.join(PATIENCE)
        assert not thread.is_alive() and not failures, failures
        _insert_without_waiting(other, "after", "second", str(vectors[1]))
    assert "vector(16)" in _hnsw_definition() and _leftovers() == []
    with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": 16}):
        # Both memories are in the index, the one written during its build too (read through it alone).
        nearest = (
            f"SELECT memory_id FROM {TABLE} WHERE {indexes.dimension_predicate()} "
            f"ORDER BY {indexes.embedding_sql()} <=> %s::vector LIMIT 1"
        )
        _sql("SET enable_seqscan = off")
        try:
            for i, memory_id in enumerate(("during-build", "after")):
                assert _sql(nearest, [str(vectors[i])]) == [(memory_id,)]
                plan = _sql("EXPLAIN " + nearest, [str(vectors[i])])
                assert any(f"Index Scan using {indexes.HNSW_INDEX}" in row[0] for row in plan), plan
        finally:
            _sql("RESET enable_seqscan")


@pytest.mark.parametrize("left", ["invalid", "for other settings"])
def test_a_rerun_rebuilds_a_new_hnsw_index_it_cannot_trust(left):
    with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": 16}):
        temporary = indexes.HNSW_INDEX + indexes.NEW_SUFFIX
        if left == "invalid":  # the build killed on the server
            _interrupted_build(temporary, indexes.hnsw_index_definition())
        else:  # built before the settings changed again
            with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": 12}):
                _sql(f"CREATE INDEX {temporary} ON {indexes.hnsw_index_definition()}")
        stale = _index_oid(temporary)
        assert "HNSW index: built and swapped in." in _rebuild()
        with connections["postgres"].cursor() as cursor:
            assert indexes.hnsw_index_current(cursor, indexes.HNSW_INDEX)
        assert _index_oid(indexes.HNSW_INDEX) != stale and _leftovers() == []
        assert checks.check_search_indexes(databases=["postgres"]) == []


def test_a_rerun_after_a_kill_between_build_and_swap_swaps_the_built_index_in_without_blocking_writes():
    """The swap renames the indexes (a lock on the index, not the table): it goes through while
    a writer's transaction is open, and only the CONCURRENT drop of the old index waits for it."""
    with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": 16}):
        temporary = indexes.HNSW_INDEX + indexes.NEW_SUFFIX
        _sql(f"CREATE INDEX {temporary} ON {indexes.hnsw_index_definition()}")
        built = _index_oid(temporary)
        holder = _other_connection()
        with holder, _other_connection() as other:
            holder.autocommit = False
            holder.execute(f"LOCK TABLE {TABLE} IN ROW EXCLUSIVE MODE")  # a writer's open transaction
            thread, failures = _in_thread(_rebuild)
            try:
                _wait_until(
                    "SELECT 1 FROM pg_stat_activity WHERE query LIKE 'DROP INDEX CONCURRENTLY%%' "
                    "AND wait_event_type = 'Lock'",
                    [],
                )
                assert _index_oid(indexes.HNSW_INDEX) == built  # swapped in, not built again
                _insert_without_waiting(other, "during-drop", "words", str(_embeddings(1, 16)[0]))
            finally:
                holder.rollback()
                thread.join(PATIENCE)
            assert not thread.is_alive() and not failures, failures
        assert "vector(16)" in _hnsw_definition() and _leftovers() == []
        old = indexes.HNSW_INDEX + indexes.OLD_SUFFIX
        _sql(f"CREATE INDEX {old} ON {TABLE} (id)")  # killed after the swap, before the drop
        assert "HNSW index: already built" in _rebuild()
        assert _index_oid(indexes.HNSW_INDEX) == built and _leftovers() == []


@pytest.mark.parametrize("index", ["dropped", "invalid"])
def test_a_rerun_after_an_interrupted_rewrite_rewrites_the_rest(index):
    """Killed during the rewrite (the index dropped) or during the index build (left invalid):
    half the vectors still in 'english', the trigger on 'simple', search correct and slow."""
    _load(10, "u", "The cats are sleeping")
    with override_settings(AFKMEMORY=SIMPLE):
        indexes.drop_index_concurrently(connections["postgres"], indexes.VECTOR_GIN_INDEX)
        indexes.run_with_lock_timeout(
            connections["postgres"], [indexes.vector_function_sql(), indexes.vector_trigger_sql()]
        )
        _sql(f"UPDATE {TABLE} SET search_vector = to_tsvector('simple', search_text) WHERE memory_id < 'u-5'")
        if index == "invalid":
            _interrupted_build(indexes.VECTOR_GIN_INDEX, indexes.vector_index_definition())
        assert len(_out_of_step()) == 5 and not indexes.stored_vectors("postgres")
        store = SyncDjangoMemoryStore(using="postgres")
        sql, found = _statement_of_search(store, "u", "cats")
        assert "search_vector" not in sql and len(found) == 10
        assert store.search_long_term_memory_text("u", "cat") == []

        out = _rebuild()
        assert "the trigger fills them" not in out and "rewrote 10 in 'simple'" in out
        assert _out_of_step() == [] and indexes.stored_vectors("postgres")
        with connections["postgres"].cursor() as cursor:
            assert indexes.index_state(cursor, indexes.VECTOR_GIN_INDEX) == "valid"
        sql, found = _statement_of_search(store, "u", "cats")
        assert "search_vector" in sql and len(found) == 10
        assert store.search_long_term_memory_text("u", "cat") == []


@pytest.mark.parametrize("killed", [False, True])
def test_the_trigger_switch_waits_for_processes_that_searched_the_old_vectors(monkeypatch, killed):
    """Their index dropped now, or by a run killed during its wait: the rerun waits again before
    rewriting vectors a process may still search in 'english'. An index never valid is no wait."""
    _load(3, "u", "The cats are sleeping")
    events: list[str] = []
    monkeypatch.setattr(indexes, "SEARCH_VECTORS_TTL", 0.25)
    monkeypatch.setattr(indexes.time, "sleep", lambda seconds: events.append(f"sleep {seconds}"))
    if killed:
        indexes.drop_index_concurrently(connections["postgres"], indexes.VECTOR_GIN_INDEX)
    with override_settings(AFKMEMORY=SIMPLE):
        out = _rebuild()
        assert _out_of_step() == [] and indexes.stored_vectors("postgres")
    assert "waiting 0.25 s" in out and "sleep 0.25" in events
    assert out.index("waiting 0.25 s") < out.index("the trigger fills them in 'simple'")

    events.clear()
    indexes.drop_index_concurrently(connections["postgres"], indexes.VECTOR_GIN_INDEX)
    with override_settings(AFKMEMORY=SIMPLE):
        _interrupted_build(indexes.VECTOR_GIN_INDEX, indexes.vector_index_definition())
    out = _rebuild()  # back to 'english' from an index that never served: nothing searched it
    assert "waiting" not in out and events == [] and _out_of_step() == []


def test_the_expression_index_of_a_schema_before_0008_is_rebuilt_online():
    _load(5, "u", "The cats are sleeping")
    _old_schema()
    with override_settings(AFKMEMORY=SIMPLE):
        out = _rebuild()
        assert "Text search expression index: built and swapped in." in out and "Stored text" not in out
        definition = _sql("SELECT pg_get_indexdef(to_regclass(%s))", [indexes.GIN_INDEX])[0][0]
        assert "to_tsvector('simple'::regconfig, search_text)" in definition and _leftovers() == []
        store = SyncDjangoMemoryStore(using="postgres")
        sql, found = _statement_of_search(store, "u", "cats")
        assert "to_tsvector('simple'" in sql and len(found) == 5
        assert store.search_long_term_memory_text("u", "cat") == []
        assert "already on 'simple'; kept" in _rebuild()


@pytest.mark.django_db(databases=["default"])
def test_sqlite_refuses_concurrently():
    with pytest.raises(CommandError, match="PostgreSQL only"):
        call_command("afkmemory_rebuild_indexes", database="default", concurrently=True, stdout=StringIO())


@pytest.mark.parametrize("concurrently", [True, False])
def test_a_second_rebuild_while_one_runs_is_refused_and_changes_nothing(concurrently):
    """Two --concurrently runs at once deadlocked on each other's index builds, or collided
    replacing the trigger, and one died with PostgreSQL's error: one runs, the other is told."""
    from afkmemory.management.commands.afkmemory_rebuild_indexes import REBUILD_LOCK

    before = _hnsw_definition()
    other = _other_connection()
    try:
        other.execute("SELECT pg_advisory_lock(%s)", [REBUILD_LOCK])  # a rebuild under way elsewhere
        refused = pytest.raises(CommandError, match="another afkmemory_rebuild_indexes is running")
        with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": 8, "HNSW_M": 24}), refused:
            if concurrently:
                _rebuild()
            else:
                call_command("afkmemory_rebuild_indexes", database="postgres", stdout=StringIO())
        assert _hnsw_definition() == before
        other.execute("SELECT pg_advisory_unlock(%s)", [REBUILD_LOCK])
        with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": 8, "HNSW_M": 24}):
            _rebuild()  # the lock is free again, and the refused run held none of its own
        assert "m='24'" in _hnsw_definition()
    finally:
        other.close()
