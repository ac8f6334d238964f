"""Workload 3: vector search over 100,000 memories of 384 dimensions, 100 users, filtered by one user.

The data are clustered, as real embeddings are: 1,000 topics, each memory a topic's
centre plus noise, normalised; each user holds 1,000 memories over 20 topics, and a
query is a noisy point of one of the asking user's topics. Ground truth is the exact top 10 of
that user's memories (numpy, float64); recall@10 is the share of it each search finds.

Configurations, interleaved round by round:

- afkmemory as shipped (``search_long_term_memory_vector``): a user's 1,000 memories are
  over ``EXACT_SEARCH_THRESHOLD`` (500) but under the cost rule's bound (``HNSW_TUPLE_COST``:
  sqrt(16 x 10 x 100,000) = 4,000 candidates), so they are ranked exactly through the btree;
- afkmemory through HNSW (``EXACT_SEARCH_THRESHOLD`` and ``HNSW_TUPLE_COST`` 0): the index
  path for the same users, as a project that knows its users' memories sit near their
  queries may configure it;
- both again with ``async_pool=True`` (the search on the store's own connections);
- as shipped on an alias with Django's ``server_side_binding`` and prepared statements;
- the exact scan of all 100,000 rows (sequential scan, the user filter applied in it):
  the rate the 20x target is measured against;
- the same store call without the HNSW index (dropped at the end), in a pass of its own
  with the exact scan measured again beside it: each ratio's two sides come from the same
  rounds (``extra["exact_scan"]`` names the row a configuration is divided by);
- unfiltered, raw SQL: HNSW (``ef_search`` 100) against the exact scan, the textbook case.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import numpy as np
from django.db import connection

from .common import PREPARED_ALIAS, psql
from .measure import Result, Round, Scale, run_async, summarize
from .report import ON_PREPARED

log = logging.getLogger("bench")

TOPICS = 1_000
TOPICS_PER_USER = 20
NOISE = 0.5
K = 10
#: The store with ``async_pool=True``: the search sent from the event loop, prepared, the vector in binary.
POOLED = "afkmemory(async_pool=True)"
#: The default store on an alias with Django's server_side_binding and prepared statements.
PREPARED = f"afkmemory {ON_PREPARED}"
#: The filtered exact scan, measured in the pass with the HNSW index and again in the one without.
THROUGH_HNSW = "afkmemory through HNSW (HNSW_TUPLE_COST 0)"
EXACT = "exact scan of all rows (filter in the scan)"
EXACT_NO_HNSW = "exact scan of all rows, beside the row without HNSW"
EXACT_UNFILTERED = "exact scan, unfiltered (raw SQL)"
#: The store with no HNSW index at all: what the user_id btree alone gives.
NO_HNSW = "afkmemory without HNSW index"


def make_data(scale: Scale, seed: int = 7) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return (vectors, user of each vector, queries, user of each query).

    Each user writes about 20 of the 1,000 topics; a memory is its topic's centre plus
    Gaussian noise (norm 0.5 of the centre's), normalised. A query is a fresh noisy point
    of one of the asking user's topics, so its true neighbours are that user's memories
    of that topic, ranked by the noise: a continuum of similarities, as with real text.
    """
    rng = np.random.default_rng(seed)
    n, d, users_n = scale.vectors, scale.vector_dims, scale.vector_users
    centres = rng.standard_normal((TOPICS, d)).astype(np.float32)
    user_topics = rng.integers(0, TOPICS, (users_n, TOPICS_PER_USER))
    users = np.arange(n) % users_n
    topic = user_topics[users, rng.integers(0, TOPICS_PER_USER, n)]
    vectors = centres[topic] + NOISE * rng.standard_normal((n, d)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    q_users = rng.integers(0, users_n, scale.vector_queries)
    q_topics = user_topics[q_users, rng.integers(0, TOPICS_PER_USER, scale.vector_queries)]
    queries = centres[q_topics] + NOISE * rng.standard_normal((scale.vector_queries, d)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    return vectors, users, queries.astype(np.float32), q_users


def truth(vectors: np.ndarray, users: np.ndarray, queries: np.ndarray, q_users: np.ndarray) -> list[set[str]]:
    out = []
    v64 = vectors.astype(np.float64)
    for q, u in zip(queries, q_users, strict=True):
        idx = np.flatnonzero(users == u)
        scores = v64[idx] @ q.astype(np.float64)
        out.append({f"m{i}" for i in idx[np.argsort(-scores, kind="stable")[:K]]})
    return out


def truth_unfiltered(vectors: np.ndarray, queries: np.ndarray) -> list[set[str]]:
    scores = queries.astype(np.float64) @ vectors.astype(np.float64).T
    return [{f"m{i}" for i in np.argsort(-row, kind="stable")[:K]} for row in scores]


def load(vectors: np.ndarray, users: np.ndarray) -> float:
    """COPY the memories in (HNSW index dropped first), then build the index; return its build time."""
    from pgvector.psycopg import register_vector

    from afkmemory import indexes

    hnsw_sql = indexes.create_statements("postgresql")[0]
    psql(f"DROP INDEX IF EXISTS {indexes.HNSW_INDEX}")
    raw = connection.connection
    register_vector(raw)
    with (
        raw.cursor() as cur,
        cur.copy(
            "COPY afkmemory_longtermmemory (memory_id, user_id, scope, data, text, tags, metadata, created_at, "
            "updated_at, embedding, search_text) FROM STDIN WITH (FORMAT BINARY)"
        ) as copy,
    ):
        copy.set_types(["text", "text", "text", "jsonb", "text", "jsonb", "jsonb", "int8", "int8", "vector", "text"])
        for i, vector in enumerate(vectors):
            copy.write_row((f"m{i}", f"user{users[i]}", "global", "{}", None, "[]", "{}", i, i, vector, ""))
    raw.commit() if not raw.autocommit else None
    psql("SET maintenance_work_mem = '1GB'")
    t0 = time.perf_counter()
    psql(hnsw_sql)
    build = time.perf_counter() - t0
    psql("VACUUM ANALYZE afkmemory_longtermmemory")
    return build


async def run(scale: Scale, url: str) -> list[Result]:
    from asgiref.sync import sync_to_async
    from pgvector.psycopg import register_vector_async
    from psycopg_pool import AsyncConnectionPool

    from afkmemory import indexes
    from afkmemory.stores import DjangoMemoryStore, memory

    vectors, users, queries, q_users = make_data(scale)
    log.info("vector: loading %d x %d memories of %d users", *vectors.shape, scale.vector_users)
    build_s = await sync_to_async(load)(vectors, users)
    log.info("vector: HNSW index built in %.1f s", build_s)
    expected = truth(vectors, users, queries, q_users)
    expected_all = truth_unfiltered(vectors, queries)
    store = DjangoMemoryStore()
    pooled = DjangoMemoryStore(async_pool=True)
    prepared = DjangoMemoryStore(using=PREPARED_ALIAS)
    qlist = [q.tolist() for q in queries]

    async with contextlib.AsyncExitStack() as stack:
        pool = AsyncConnectionPool(url, min_size=8, max_size=8, open=False, configure=register_vector_async)
        await pool.open(wait=True)
        stack.push_async_callback(pool.close)

        async def store_search(i: int, store: DjangoMemoryStore = store) -> list[str]:
            n = i % len(qlist)
            hits = await store.search_long_term_memory_vector(f"user{q_users[n]}", qlist[n], limit=K)
            return [m.id for m, _ in hits]

        def pooled_search(i: int) -> Any:
            return store_search(i, pooled)

        def prepared_search(i: int) -> Any:
            return store_search(i, prepared)

        async def raw_sql(i: int, *, filtered: bool, hnsw: bool) -> list[str]:
            n = i % len(qlist)
            # The index is on embedding::vector(384), partial on the dimension; the bare
            # column, or a query without the predicate, cannot use it.
            conditions = ["user_id = %(u)s AND owner_id IS NULL"] if filtered else []
            if hnsw:
                conditions.append(indexes.dimension_predicate())
            where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
            column = indexes.embedding_sql() if hnsw else "embedding"
            async with pool.connection() as conn, conn.transaction():
                if hnsw:
                    await conn.execute("SET LOCAL hnsw.ef_search = 100")
                else:
                    await conn.execute("SET LOCAL enable_indexscan = off")
                    await conn.execute("SET LOCAL enable_bitmapscan = off")
                cur = await conn.execute(
                    f"SELECT memory_id FROM afkmemory_longtermmemory {where} "
                    f"ORDER BY {column} <=> %(q)s::vector LIMIT {K}",
                    {"u": f"user{q_users[n]}", "q": queries[n]},
                )
                return [r[0] for r in await cur.fetchall()]

        def exact_scan(i: int) -> Any:
            return raw_sql(i, filtered=True, hnsw=False)

        # The HNSW path for every user: the threshold and the cost rule off (HNSW_TUPLE_COST).
        threshold0 = {"EMBEDDING_DIMENSIONS": scale.vector_dims, "EXACT_SEARCH_THRESHOLD": 0, "HNSW_TUPLE_COST": 0}
        fast_ops = scale.vector_queries
        slow_ops = max(scale.vector_queries // 5, 4)
        configs: dict[str, tuple[Any, dict | None, int, list[set[str]], str]] = {
            "afkmemory (as shipped)": (store_search, None, fast_ops, expected, "user"),
            THROUGH_HNSW: (store_search, threshold0, fast_ops, expected, "user"),
            f"{POOLED} (as shipped)": (pooled_search, None, fast_ops, expected, "user"),
            f"{POOLED} through HNSW": (pooled_search, threshold0, fast_ops, expected, "user"),
            f"{PREPARED} (as shipped)": (prepared_search, None, fast_ops, expected, "user"),
            EXACT: (exact_scan, None, slow_ops, expected, "user"),
            "HNSW, unfiltered (raw SQL)": (
                lambda i: raw_sql(i, filtered=False, hnsw=True),
                None,
                fast_ops,
                expected_all,
                "all",
            ),
            EXACT_UNFILTERED: (
                lambda i: raw_sql(i, filtered=False, hnsw=False),
                None,
                slow_ops,
                expected_all,
                "all",
            ),
        }
        results = await _measure(configs, scale, len(qlist))
        for r in results:
            r.extra["exact_scan"] = EXACT if r.case == "user" else EXACT_UNFILTERED
        results += await _ef_sweep(store_search, scale, len(qlist), expected)

        # The same store calls with no HNSW index at all, and the exact scan again beside them,
        # so the ratio of the two is taken in one pass (the machine's speed drifts between passes).
        await sync_to_async(psql)(f"DROP INDEX {indexes.HNSW_INDEX}")
        await sync_to_async(psql)("ANALYZE afkmemory_longtermmemory")
        # The stores read whether an HNSW index can serve once a minute (_memory_table_stats):
        # without this, the first minute's searches took the HNSW branch on a table without one.
        memory._TABLE_ROWS.clear()
        no_index = {
            NO_HNSW: (store_search, threshold0, fast_ops, expected, "user"),
            EXACT_NO_HNSW: (exact_scan, None, slow_ops, expected, "user"),
        }
        without = await _measure(no_index, scale, len(qlist))
        for r in without:
            r.extra["exact_scan"] = EXACT_NO_HNSW
        results += without
        for r in results:
            r.extra.update(hnsw_build_s=round(build_s, 1), vectors=scale.vectors, dims=scale.vector_dims)
        return results


@contextlib.contextmanager
def _settings(overrides: dict | None):
    from django.test import override_settings

    if overrides is None:
        yield
    else:
        with override_settings(AFKMEMORY=overrides):
            yield


async def _measure(configs: dict, scale: Scale, nq: int) -> list[Result]:
    names = list(configs)
    recall: dict[str, float] = {}
    for name in names:
        op, overrides, _, expected, _ = configs[name]
        with _settings(overrides):
            found = [await op(i) for i in range(nq)]
        recall[name] = float(np.mean([len(set(f) & e) / K for f, e in zip(found, expected, strict=True)]))
        log.info("  vector     %-45s recall@10 %.3f", name, recall[name])
    results = []
    for mode, concurrency in (("seq", 1), ("c8", 8)):
        rounds: dict[str, list[Round]] = {n: [] for n in names}
        for r in range(scale.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                op, overrides, ops, _, _ = configs[name]
                with _settings(overrides):
                    await run_async(op, 4, 1, start=r * 7)  # warm caches after the settings switch
                    rounds[name].append(await run_async(op, ops, concurrency, start=r * 31))
        for name in names:
            res = summarize("vector", configs[name][4], name, mode, rounds[name], recall_at_10=round(recall[name], 4))
            log.info(
                "  vector     %-45s %-4s %8.1f q/s  p50 %7.2f ms  p99 %7.2f ms",
                name,
                mode,
                res.ops_per_s,
                res.p50_ms,
                res.p99_ms,
            )
            results.append(res)
    return results


async def _ef_sweep(store_search: Any, scale: Scale, nq: int, expected: list[set[str]]) -> list[Result]:
    """Recall and speed of the store's HNSW path (threshold 0) as ``HNSW_EF_SEARCH`` grows."""
    results = []
    for ef in (40, 100, 200, 400, 800):
        overrides = {"EMBEDDING_DIMENSIONS": scale.vector_dims, "EXACT_SEARCH_THRESHOLD": 0, "HNSW_EF_SEARCH": ef,
                     "HNSW_TUPLE_COST": 0}  # fmt: skip
        with _settings(overrides):
            found = [await store_search(i) for i in range(nq)]
            rnd = await run_async(store_search, nq, 1)
        recall = float(np.mean([len(set(f) & e) / K for f, e in zip(found, expected, strict=True)]))
        res = summarize(
            "vector",
            "ef_search",
            f"afkmemory via HNSW, ef_search {ef}",
            "sweep",
            [rnd],
            recall_at_10=round(recall, 4),
            ef_search=ef,
        )
        log.info(
            "  vector     ef_search %-4d recall@10 %.3f  %8.1f q/s  p99 %7.2f ms", ef, recall, res.ops_per_s, res.p99_ms
        )
        results.append(res)
    return results
