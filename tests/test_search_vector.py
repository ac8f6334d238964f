"""PostgreSQL's stored text search vector (migrations 0008 and 0009): fast, and the same results.

Text search parsed every matching memory's search text again to rank it (and, when the
planner filtered through the (owner, user_id, scope) index, to match it too): about 0.5 µs a
byte, 5.8 s for a common word in one user's 10,000 memories of 2 KB. A ``search_vector``
column, kept equal to ``to_tsvector(config, search_text)`` by a trigger and indexed by GIN,
is read instead once it is searchable; before that (new code on the old schema, a migrate
under way, a configuration changed and not rebuilt) search parses the text as before.
"""

from __future__ import annotations

import threading
import time
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import OperationalError, connections
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from afkmemory import indexes, models
from afkmemory.memory import LongTermMemory
from afkmemory.stores import SyncDjangoMemoryStore
from tests.utils import FLUSHED_APPS

pytestmark = pytest.mark.django_db(databases=["postgres"])

TABLE = indexes.MEMORY_TABLE


def _sql(sql: str, params: list | None = None) -> list[tuple]:
    with connections["postgres"].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def _out_of_step() -> list[str]:
    """Memories whose stored vector is not the configured parse of their search text."""
    config = indexes.text_search_config()
    return [
        row[0]
        for row in _sql(
            f"SELECT memory_id FROM {TABLE} "
            "WHERE search_vector IS DISTINCT FROM to_tsvector(%s::regconfig, search_text)",
            [config],
        )
    ]


def _load(count: int, user: str, text: str, start: int = 0) -> None:
    """Insert ``count`` memories of ``user`` in one statement, as old code or a bulk load writes them."""
    _sql(
        f"""
        INSERT INTO {TABLE} (memory_id, user_id, scope, data, text, tags, metadata, created_at, updated_at, search_text)
        SELECT %s || i, %s, 'global', '{{}}', %s, '[]', '{{}}', i, i, lower(%s) || ' ' || i
        FROM generate_series(%s, %s - 1) AS i
        """,
        [f"{user}-", user, text, text, start, start + count],
    )


def _statement_of_search(store: SyncDjangoMemoryStore, user: str, query: str) -> tuple[str, list[str]]:
    with CaptureQueriesContext(connections["postgres"]) as captured:
        found = store.search_long_term_memory_text(user, query)
    [sql] = [q["sql"] for q in captured.captured_queries if "ORDER BY" in q["sql"]]
    return sql, [m.id for m in found]


def _plan(sql: str, settings: str = "") -> str:
    with connections["postgres"].cursor() as cursor:
        if settings:
            cursor.execute(settings)
        cursor.execute("EXPLAIN (VERBOSE, COSTS OFF) " + sql)
        return "\n".join(row[0] for row in cursor.fetchall())


def test_a_common_word_search_reads_the_stored_vectors_not_the_text():
    """No to_tsvector on rows: not to match (Filter, Recheck Cond), not to rank (Sort Key, Output)."""
    _load(3000, "u", "Coffee with oat milk, black coffee in the morning and an espresso after lunch")
    _load(3000, "other", "Tea and coffee")
    _sql(f"ANALYZE {TABLE}")
    store = SyncDjangoMemoryStore(using="postgres")
    sql, found = _statement_of_search(store, "u", "coffee")
    assert len(found) == 20 and all(m.startswith("u-") for m in found)
    # The planner's two ways: the user's rows through the btree, or the word's through GIN.
    for forced in ("SET enable_bitmapscan = off", "SET enable_indexscan = off"):
        plan = _plan(sql, forced)
        assert "to_tsvector" not in plan, plan
        assert "search_vector @@" in plan and "ts_rank_cd(" in plan, plan
    _sql("RESET enable_bitmapscan; RESET enable_indexscan")


def test_the_word_is_found_through_the_vectors_gin_index():
    _load(2000, "u", "prefers window seats")
    _load(5, "u", "keeps a zebrafish", start=5000)
    _sql(f"ANALYZE {TABLE}")
    memories = models.LongTermMemory.objects.using("postgres")
    sql, params = memories.matching(["zebrafish"]).values("pk").query.sql_with_params()
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a small table: ask whether the index *can* serve
        cursor.execute("EXPLAIN (VERBOSE, COSTS OFF) " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("RESET enable_seqscan")
    assert f"Bitmap Index Scan on {indexes.VECTOR_GIN_INDEX}" in plan, plan
    assert "to_tsvector" not in plan, plan
    assert memories.matching(["zebrafish"]).count() == 5
    with connections["postgres"].cursor() as cursor:
        assert indexes.index_state(cursor, indexes.GIN_INDEX) is None  # 0009 dropped it


def test_the_trigger_keeps_the_vector_in_step_with_every_writer():
    store = SyncDjangoMemoryStore(using="postgres")
    store.upsert_long_term_memory(LongTermMemory("a", "u", text="walks the dogs"))  # insert
    store.upsert_long_term_memory(LongTermMemory("b", "u", text="reads novels"))
    store.upsert_long_term_memory(LongTermMemory("a", "u", text="rides bicycles"))  # update
    rows = list(models.LongTermMemory.objects.using("postgres").filter(memory_id="b"))
    rows[0].search_text = "plays chess"
    models.LongTermMemory.objects.using("postgres").bulk_update(rows, ["search_text"])
    _load(3, "raw", "Sails boats")  # a raw INSERT without the column: old code's
    _sql(f"UPDATE {TABLE} SET search_text = 'climbs mountains' WHERE memory_id = 'raw-1'")
    _sql(f"UPDATE {TABLE} SET text = 'unchanged words' WHERE memory_id = 'raw-2'")  # vector stays
    assert _sql(f"SELECT count(*) FROM {TABLE} WHERE search_vector IS NULL") == [(0,)]
    assert _out_of_step() == []
    assert [m.id for m in store.search_long_term_memory_text("u", "bicycle")] == ["a"]
    assert [m.id for m in store.search_long_term_memory_text("u", "chess")] == ["b"]
    assert store.search_long_term_memory_text("u", "dogs") == []
    assert [m.id for m in store.search_long_term_memory_text("raw", "mountain")] == ["raw-1"]
    assert [m.id for m in store.search_long_term_memory_text("raw", "boats")] == ["raw-2", "raw-0"]  # newest first


def _ranking_data(store: SyncDjangoMemoryStore) -> None:
    texts = {
        "one": "coffee",
        "two": "coffee and more coffee",
        "far": "coffee " + "filler " * 40 + "coffee",
        "stem": "coffees brewed",
        "none": "tea only",
        "tie1": "black coffee",
        "tie2": "black coffee",
    }
    for i, (memory_id, text) in enumerate(texts.items()):
        store.upsert_long_term_memory(LongTermMemory(memory_id, "u", text=text, created_at=i, updated_at=i))


def _ranked(store: SyncDjangoMemoryStore, query: str) -> tuple[list[str], list[float], str]:
    sql, found = _statement_of_search(store, "u", query)
    config = indexes.text_search_config()
    ranks = [
        row[0]
        for row in _sql(
            f"SELECT ts_rank_cd(to_tsvector(%s::regconfig, search_text), plainto_tsquery(%s::regconfig, %s)) "
            f"FROM {TABLE} WHERE memory_id = ANY(%s) ORDER BY array_position(%s, memory_id)",
            [config, config, query, found, found],
        )
    ]
    return found, ranks, sql


def _old_schema() -> None:
    """The schema before 0008: no column, no trigger, the expression index."""
    _sql(f"DROP INDEX {indexes.VECTOR_GIN_INDEX}")
    _sql(f"DROP TRIGGER {indexes.VECTOR_TRIGGER} ON {TABLE}")
    _sql(f"ALTER TABLE {TABLE} DROP COLUMN {indexes.VECTOR_COLUMN}")
    _sql(f"CREATE INDEX {indexes.GIN_INDEX} ON {indexes.expression_index_definition()}")
    indexes.forget_search_vectors()


def test_every_upgrade_state_finds_every_memory_and_ranks_it_the_same():
    """Old schema, column added and backfill under way, complete: the same memories, in the same order."""
    store = SyncDjangoMemoryStore(using="postgres")
    _ranking_data(store)
    queries = ["coffee", "black coffee", "brewed", "tea"]
    complete = {q: _ranked(store, q) for q in queries}
    assert all("search_vector" in sql for _, _, sql in complete.values())
    found, ranks, _ = complete["coffee"]
    assert sorted(found) == ["far", "one", "stem", "tie1", "tie2", "two"] and ranks == sorted(ranks, reverse=True)
    assert len(set(ranks)) > 1  # ranked by ts_rank_cd, not all alike
    _sql("SET CONSTRAINTS ALL IMMEDIATE")  # ALTER TABLE refuses to run with the owner checks pending

    _old_schema()  # new code before migrate: searches as before, through the expression index
    old = {q: _ranked(store, q) for q in queries}
    assert all("search_vector" not in sql and "to_tsvector" in sql for _, _, sql in old.values())
    store.upsert_long_term_memory(LongTermMemory("new", "u", text="iced coffee", created_at=9, updated_at=9))
    _sql("SET CONSTRAINTS ALL IMMEDIATE")

    # 0008 under way: the column and trigger are there, half of the memories backfilled.
    indexes.add_search_vector(connections["postgres"])
    _sql(f"UPDATE {TABLE} SET search_vector = to_tsvector('english', search_text) WHERE memory_id < 'n'")
    store.upsert_long_term_memory(LongTermMemory("newer", "u", text="cold coffee", created_at=10, updated_at=10))
    assert _sql(f"SELECT count(*) FROM {TABLE} WHERE search_vector IS NULL")[0][0] > 0
    assert not indexes.stored_vectors("postgres")
    half = {q: _ranked(store, q) for q in queries}
    assert all("search_vector" not in sql for _, _, sql in half.values())

    # 0008 done, 0009's index built: the vectors are searched, without a restart.
    assert indexes.backfill_search_vectors(connections["postgres"], batch_rows=2) > 0
    assert _out_of_step() == []
    _sql(f"CREATE INDEX {indexes.VECTOR_GIN_INDEX} ON {indexes.vector_index_definition()}")
    assert not indexes.stored_vectors("postgres")  # what this process read a moment ago, for a few seconds
    indexes._SEARCH_VECTORS["postgres"] = (time.monotonic() - indexes.SEARCH_VECTORS_TTL, None)
    assert indexes.stored_vectors("postgres")
    done = {q: _ranked(store, q) for q in queries}
    assert all("search_vector" in sql for _, _, sql in done.values())

    for q in queries:
        before = complete[q][:2]
        assert old[q][:2] == before
        assert half[q][0] == done[q][0] and half[q][1] == done[q][1]
        assert [m for m in done[q][0] if m not in ("new", "newer")] == before[0]
    assert set(done["coffee"][0]) >= {"new", "newer"} and len(done["coffee"][0]) == 8


def test_a_backfill_batch_is_bounded_by_rows_and_by_bytes():
    _load(10, "u", "short words")
    _load(3, "big", "long " * 50000, start=100)
    _sql("SET CONSTRAINTS ALL IMMEDIATE")
    _sql(f"UPDATE {TABLE} SET search_vector = NULL")
    with CaptureQueriesContext(connections["postgres"]) as captured:
        assert indexes.backfill_search_vectors(connections["postgres"], batch_rows=4, batch_bytes=200_000) == 13
    updates = [q["sql"] for q in captured.captured_queries if q["sql"].startswith("UPDATE")]
    # 4 + 4 rows; then 2 short ones and the first 250 KB memory (the batch's first 200 KB were
    # not used up before it), then each of the others alone.
    assert len(updates) == 5
    assert _out_of_step() == []
    assert indexes.backfill_search_vectors(connections["postgres"]) == 0


def test_rebuild_indexes_after_a_configuration_change_rebuilds_the_trigger_vectors_and_index():
    store = SyncDjangoMemoryStore(using="postgres")
    store.upsert_long_term_memory(LongTermMemory("m", "u", text="The cats are sleeping", updated_at=1))
    _sql("SET CONSTRAINTS ALL IMMEDIATE")
    with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": 8, "TEXT_SEARCH_CONFIG": "simple"}):
        # Not rebuilt yet: the vectors are 'english' ones, so search parses the text in 'simple'.
        assert not indexes.stored_vectors("postgres")
        assert [m.id for m in store.search_long_term_memory_text("u", "the")] == ["m"]
        call_command("afkmemory_rebuild_indexes", database="postgres", stdout=StringIO())
        assert indexes.stored_vectors("postgres")
        assert _out_of_step() == []
        store.upsert_long_term_memory(LongTermMemory("n", "u", text="the cat", updated_at=2))
        assert _out_of_step() == []  # the trigger writes 'simple' vectors now
        sql, found = _statement_of_search(store, "u", "the")
        assert "search_vector" in sql and found == ["n", "m"]
        assert [m.id for m in store.search_long_term_memory_text("u", "cats")] == ["m"]  # no stemming
        with connections["postgres"].cursor() as cursor:
            assert indexes.index_state(cursor, indexes.VECTOR_GIN_INDEX) == "valid"
            assert indexes.index_state(cursor, indexes.GIN_INDEX) is None
    assert not indexes.stored_vectors("postgres")  # back to 'english': rebuild again
    call_command("afkmemory_rebuild_indexes", database="postgres", stdout=StringIO())
    assert indexes.stored_vectors("postgres") and _out_of_step() == []
    assert store.search_long_term_memory_text("u", "the") == []
    assert [m.id for m in store.search_long_term_memory_text("u", "cats")] == ["n", "m"]


def test_rebuild_indexes_on_the_old_schema_builds_the_expression_index_as_before():
    _sql("SET CONSTRAINTS ALL IMMEDIATE")
    _old_schema()
    call_command("afkmemory_rebuild_indexes", database="postgres", stdout=StringIO())
    with connections["postgres"].cursor() as cursor:
        assert indexes.index_state(cursor, indexes.GIN_INDEX) == "valid"
        assert indexes.index_state(cursor, indexes.VECTOR_GIN_INDEX) is None
        assert not indexes.has_vector_column(cursor)


@pytest.mark.django_db(databases=["postgres"], transaction=True, available_apps=FLUSHED_APPS)
def test_adding_the_column_gives_up_its_lock_wait_instead_of_blocking_readers():
    """A transaction holding the table keeps ALTER TABLE waiting; readers queue behind the ALTER
    only for the lock timeout, and the migration tries again once the transaction ends."""
    connection = connections["postgres"]
    holder, reader = (connection.get_new_connection(connection.get_connection_params()) for _ in range(2))
    holder.autocommit, reader.autocommit = False, True
    with holder, reader:
        holder.execute(f"SELECT count(*) FROM {TABLE}")  # an open transaction holding ACCESS SHARE
        started = time.monotonic()
        with pytest.raises(OperationalError):
            indexes.run_with_lock_timeout(connection, [f"ALTER TABLE {TABLE} ADD COLUMN probe int"], attempts=1)
        assert indexes.DDL_LOCK_TIMEOUT_MS / 1000 <= time.monotonic() - started < 10
        waited: list[float] = []

        def read() -> None:
            time.sleep(0.5)  # while the ALTER waits for the lock
            begun = time.monotonic()
            reader.execute(f"SELECT count(*) FROM {TABLE}")
            waited.append(time.monotonic() - begun)

        threading.Timer(3.5, holder.rollback).start()  # the long transaction ends during the second pause
        thread = threading.Thread(target=read)
        thread.start()
        indexes.run_with_lock_timeout(connection, [f"ALTER TABLE {TABLE} ADD COLUMN probe int"], attempts=3)
        thread.join()
        assert waited and waited[0] < indexes.DDL_LOCK_TIMEOUT_MS / 1000 + 1
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {TABLE} DROP COLUMN probe")


def test_migration_0009_waits_for_other_processes_only_where_the_table_holds_many_memories(monkeypatch):
    """On a table never analysed (every new database's first migrate) 0009 slept its full
    SEARCH_VECTORS_TTL (10 s) for processes that could not exist: it counts the rows instead."""
    import importlib

    migration = importlib.import_module("afkmemory.migrations.0009_memory_search_vector_index")
    slept: list[float] = []
    monkeypatch.setattr(migration.time, "sleep", slept.append)
    monkeypatch.setattr(migration, "WAIT_FROM_ROWS", 3)
    _sql("UPDATE pg_class SET reltuples = -1 WHERE oid = %s::regclass", [indexes.MEMORY_TABLE])  # never analysed
    store = SyncDjangoMemoryStore(using="postgres")
    for count in range(4):
        with connections["postgres"].cursor() as cursor:
            migration.wait_for_searches(cursor)
        assert slept == ([indexes.SEARCH_VECTORS_TTL] if count == 3 else []), count
        store.upsert_long_term_memory(LongTermMemory(f"m{count}", "u", text="x"))
    with connections["postgres"].cursor() as cursor:
        migration.wait_for_searches(cursor, always=True)  # backwards: whatever the table holds
    assert len(slept) == 2
