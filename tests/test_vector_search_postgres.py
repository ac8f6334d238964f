"""Vector search on PostgreSQL: a selective filter still fills the limit through the HNSW index."""

from __future__ import annotations

import numpy as np
import pytest
from django.db import connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from afkmemory import models
from afkmemory.indexes import HNSW_INDEX
from afkmemory.stores import SyncDjangoMemoryStore
from tests.conftest import DIMENSIONS

pytestmark = pytest.mark.django_db(databases=["postgres"])

BIG, SMALL = 5000, 30


def _populate(rng: np.random.Generator) -> dict[str, np.ndarray]:
    rows, small = [], {}
    for i in range(BIG + SMALL):
        user = "small" if i < SMALL else "big"
        vector = rng.normal(size=DIMENSIONS).astype(np.float32)
        ident = f"{user}-{i}"
        if user == "small":
            small[ident] = vector
        rows.append(
            models.LongTermMemory(
                memory_id=ident, user_id=user, scope="global", created_at=1, updated_at=1, embedding=vector
            )
        )
    models.LongTermMemory.objects.using("postgres").bulk_create(rows, batch_size=1000)
    with connections["postgres"].cursor() as cursor:
        cursor.execute(f"ANALYZE {models.LongTermMemory._meta.db_table}")
    return small


def _exact_top(small: dict[str, np.ndarray], query: np.ndarray, k: int) -> list[tuple[str, float]]:
    q = query.astype(np.float64)
    scored = [(i, float(v.astype(np.float64) @ q / np.linalg.norm(v) / np.linalg.norm(q))) for i, v in small.items()]
    return sorted(scored, key=lambda s: -s[1])[:k]


def _statements(captured) -> list[str]:
    # The HNSW path sends its settings and its search as one query string (one round trip).
    return [sql for q in captured.captured_queries for sql in q["sql"].split("; ")]


def _search(store, query, limit):
    with CaptureQueriesContext(connections["postgres"]) as captured:
        hits = store.search_long_term_memory_vector("small", query.tolist(), limit=limit)
    settings_sql = [sql for sql in _statements(captured) if sql.startswith("SET LOCAL")]
    search_sql = [sql for sql in _statements(captured) if "<=>" in sql][-1]
    return hits, settings_sql, search_sql


def _plan(settings_sql, search_sql):
    with transaction.atomic(using="postgres"), connections["postgres"].cursor() as cursor:
        for sql in settings_sql:
            cursor.execute(sql)
        cursor.execute("EXPLAIN " + search_sql)
        return "\n".join(row[0] for row in cursor.fetchall())


@override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": DIMENSIONS, "EXACT_SEARCH_THRESHOLD": 10, "HNSW_EF_SEARCH": 40})
def test_selective_filter_returns_limit_results_in_exact_order():
    rng = np.random.default_rng(42)
    small = _populate(rng)
    store = SyncDjangoMemoryStore(using="postgres")
    for _ in range(5):
        query = rng.normal(size=DIMENSIONS).astype(np.float32)
        hits, settings_sql, _ = _search(store, query, 10)
        expected = _exact_top(small, query, 10)
        assert [m.id for m, _ in hits] == [i for i, _ in expected]
        assert [s for _, s in hits] == pytest.approx([s for _, s in expected], abs=1e-5)
    assert "SET LOCAL hnsw.iterative_scan = strict_order" in settings_sql  # more than 10 candidates


@override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": DIMENSIONS, "EXACT_SEARCH_THRESHOLD": 10, "HNSW_EF_SEARCH": 40})
def test_iterative_index_scan_fills_the_limit_where_a_plain_hnsw_scan_overfilters():
    rng = np.random.default_rng(43)
    small = _populate(rng)
    store = SyncDjangoMemoryStore(using="postgres")
    # With fresh statistics the planner rightly reads 30 rows through the btree; make
    # sorting look expensive so it takes the HNSW index, the path a big filter would take.
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SET LOCAL enable_sort = off")
    for _ in range(5):
        query = rng.normal(size=DIMENSIONS).astype(np.float32)
        hits, settings_sql, search_sql = _search(store, query, 10)
        expected = _exact_top(small, query, 10)
        assert [m.id for m, _ in hits] == [i for i, _ in expected]
    assert HNSW_INDEX in _plan(settings_sql, search_sql)
    # The same index scan without the iterative scan returns too few rows: the pitfall is real here.
    with transaction.atomic(using="postgres"), connections["postgres"].cursor() as cursor:
        for sql in settings_sql:
            cursor.execute(sql)
        cursor.execute("SET LOCAL hnsw.iterative_scan = off")
        cursor.execute(search_sql)
        assert len(cursor.fetchall()) < 10


@override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": DIMENSIONS, "EXACT_SEARCH_THRESHOLD": 100})
def test_few_candidates_take_the_exact_path():
    rng = np.random.default_rng(1)
    small = _populate(rng)
    store = SyncDjangoMemoryStore(using="postgres")
    query = rng.normal(size=DIMENSIONS).astype(np.float32)
    with CaptureQueriesContext(connections["postgres"]) as captured:
        hits = store.search_long_term_memory_vector("small", query.tolist(), limit=SMALL + 5)
    assert [m.id for m, _ in hits] == [i for i, _ in _exact_top(small, query, SMALL)]
    assert not any(q["sql"].startswith("SET LOCAL") for q in captured.captured_queries)


@override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": DIMENSIONS, "EXACT_SEARCH_THRESHOLD": 100})
def test_exact_search_is_one_statement_and_hnsw_search_two():
    """The count and the exact ranking are one statement; the HNSW settings travel with its search."""
    rng = np.random.default_rng(5)
    small = _populate(rng)
    store = SyncDjangoMemoryStore(using="postgres")
    query = rng.normal(size=DIMENSIONS).astype(np.float32)
    with CaptureQueriesContext(connections["postgres"]) as first:
        store.search_long_term_memory_vector("small", query.tolist(), limit=10)
    # The first search reads the table's estimated size (again a minute later), and pgvector's
    # version if no search has yet.
    assert "reltuples" in first.captured_queries[0]["sql"] and len(first.captured_queries) in (2, 3)
    with CaptureQueriesContext(connections["postgres"]) as captured:
        hits = store.search_long_term_memory_vector("small", query.tolist(), limit=10)
    assert [m.id for m, _ in hits] == [i for i, _ in _exact_top(small, query, 10)]
    assert len(captured.captured_queries) == 1, captured.captured_queries  # no transaction, no SET
    with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": DIMENSIONS, "EXACT_SEARCH_THRESHOLD": 10}):
        store.search_long_term_memory_vector("small", query.tolist(), limit=10)  # reads the pgvector version
        with CaptureQueriesContext(connections["postgres"]) as captured:
            hits = store.search_long_term_memory_vector("small", query.tolist(), limit=10)
    assert len(hits) == 10
    first, second = (q["sql"] for q in captured.captured_queries)
    assert "COUNT(*)" in first and not first.startswith("SET")
    assert second.startswith("SET LOCAL hnsw.ef_search") and HNSW_INDEX not in second and "<=>" in second


def test_a_filter_too_selective_for_the_hnsw_scan_budget_is_ranked_exactly():
    # 30 of 5,030 rows: a scan of 20,000 tuples expects ~119 of them, enough for 10 (4 x 10
    # needed); a scan of 500 expects 3, so above 10 candidates the search stays exact.
    rng = np.random.default_rng(7)
    small = _populate(rng)
    store = SyncDjangoMemoryStore(using="postgres")
    query = rng.normal(size=DIMENSIONS).astype(np.float32)
    for budget, exact in ((20_000, False), (500, True)):
        config = {"EMBEDDING_DIMENSIONS": DIMENSIONS, "EXACT_SEARCH_THRESHOLD": 10, "HNSW_MAX_SCAN_TUPLES": budget}
        with override_settings(AFKMEMORY=config):
            hits, settings_sql, _ = _search(store, query, 10)
        assert [m.id for m, _ in hits] == [i for i, _ in _exact_top(small, query, 10)]
        assert (not settings_sql) == exact, (budget, settings_sql)
    # Where HNSW would find enough, the big user (5,000 rows) still takes it.
    config = {"EMBEDDING_DIMENSIONS": DIMENSIONS, "EXACT_SEARCH_THRESHOLD": 10, "HNSW_MAX_SCAN_TUPLES": 500}
    with override_settings(AFKMEMORY=config), CaptureQueriesContext(connections["postgres"]) as captured:
        store.search_long_term_memory_vector("big", query.tolist(), limit=10)
    assert any(q["sql"].startswith("SET LOCAL hnsw") for q in captured.captured_queries)


@override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": DIMENSIONS, "EXACT_SEARCH_THRESHOLD": 10, "HNSW_EF_SEARCH": 40})
def test_server_side_binding_sends_the_hnsw_settings_one_by_one_in_a_transaction(monkeypatch):
    """A prepared statement holds one command: with server-side binding each SET goes alone."""
    monkeypatch.setitem(connections["postgres"].settings_dict["OPTIONS"], "server_side_binding", True)
    rng = np.random.default_rng(6)
    small = _populate(rng)
    store = SyncDjangoMemoryStore(using="postgres")
    query = rng.normal(size=DIMENSIONS).astype(np.float32)
    with CaptureQueriesContext(connections["postgres"]) as captured:
        hits = store.search_long_term_memory_vector("small", query.tolist(), limit=10)
    assert [m.id for m, _ in hits] == [i for i, _ in _exact_top(small, query, 10)]
    sql = [q["sql"] for q in captured.captured_queries]
    assert "SET LOCAL hnsw.iterative_scan = strict_order" in sql
    assert not any(";" in s for s in sql), sql


@override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": DIMENSIONS})
def test_statements_built_for_one_owner_serve_every_owner():
    """The search statements are cached per shape, not per owner: each owner sees only its rows."""
    from django.contrib.auth import get_user_model

    users = get_user_model().objects.db_manager("postgres")
    owners = [users.create_user(username="owner-a"), users.create_user(username="owner-b"), None]
    vector = [1.0] + [0.0] * (DIMENSIONS - 1)
    for owner in owners:
        store = SyncDjangoMemoryStore(owner=owner, using="postgres")
        mine = models.LongTermMemory(memory_id=f"m-{owner}", user_id="u", created_at=1, updated_at=1)
        store.upsert_long_term_memory(mine.as_record(), embedding=vector)
    for threshold in (100, 0):  # the exact statement, then the HNSW one
        with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": DIMENSIONS, "EXACT_SEARCH_THRESHOLD": threshold}):
            for owner in owners:
                store = SyncDjangoMemoryStore(owner=owner, using="postgres")
                hits = store.search_long_term_memory_vector("u", vector, limit=10)
                assert [m.id for m, _ in hits] == [f"m-{owner}"], (threshold, owner)
