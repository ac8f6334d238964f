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


def _search(store, query, limit):
    with CaptureQueriesContext(connections["postgres"]) as captured:
        hits = store.search_long_term_memory_vector("small", query.tolist(), limit=limit)
    settings_sql = [q["sql"] for q in captured.captured_queries if q["sql"].startswith("SET LOCAL")]
    search_sql = [q["sql"] for q in captured.captured_queries if "<=>" in q["sql"]][-1]
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
