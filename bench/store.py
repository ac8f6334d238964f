"""Workload 1: agentflow's Store — put, get, search and list_namespaces over 10,000 items.

DjangoStore (and SyncDjangoStore from threads, for reference) against agentflow's own
``PostgresStore`` (asyncpg) and LangGraph's ``AsyncPostgresStore`` (psycopg 3 pool).
Every implementation holds the same items: 100 namespaces ``("users", "uNNN",
"memories")`` of 100 keys each. ``put`` overwrites an existing key (the table stays at
its size), ``search`` asks one user's namespace for 50 items, ``list_namespaces`` lists
50 of the 100 namespaces under ``("users",)``, at an offset that changes with each call
(LangGraph's batching would answer 8 concurrent identical listings with one query). Peers
get a pool of 8 connections, one per concurrent caller. "DjangoStore in own_thread()" is the same store with each
caller inside asgiref's ``ThreadSensitiveContext``, as Django's ASGI handler runs a request.
"DjangoStore(async_pool=True)" sends its statements from the event loop on its own
connections (up to ``ASYNC_POOL_SIZE``, 10), with no thread hop. "DjangoStore on a
prepared alias" is the default store on an alias with Django's ``server_side_binding``
and psycopg's prepared statements (bench/settings.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from .common import PREPARED_ALIAS, check_replayed_sql, compare_async, own_sync_thread
from .measure import Result, Scale
from .report import ON_PREPARED

log = logging.getLogger("bench")

NAMESPACES = 100
#: The floor for one caller: DjangoStore's own statements on an async psycopg pool, no framework.
#: With 8 callers it sends 8 statements where DjangoStore merges concurrent gets and puts into one.
RAW = "raw psycopg (DjangoStore's SQL)"
_T = '"afkmemory_storeitem".'
SQL = {
    "get": "SELECT "
    + ", ".join(f'{_T}"{c}" AS "{c}"' for c in ("namespace", "key", "value", "created_at", "updated_at", "expires_at"))
    + f' FROM "afkmemory_storeitem" WHERE ({_T}"owner_id" IS NULL AND ({_T}"expires_at" IS NULL OR '
    f'{_T}"expires_at" > %s) AND {_T}"key" = %s AND {_T}"namespace" = %s) LIMIT 1',
    "put": 'INSERT INTO "afkmemory_storeitem" ("owner_id", "namespace", "key", "value", "created_at", "updated_at", '
    '"expires_at") VALUES (NULL, %s, %s, %s, %s, %s, %s) ON CONFLICT ("namespace", "key") WHERE "owner_id" IS NULL '
    'DO UPDATE SET "value" = excluded."value", "created_at" = CASE WHEN "afkmemory_storeitem"."expires_at" IS NOT '
    'NULL AND "afkmemory_storeitem"."expires_at" <= excluded."updated_at" THEN excluded."created_at" ELSE '
    '"afkmemory_storeitem"."created_at" END, "updated_at" = excluded."updated_at", "expires_at" = '
    'excluded."expires_at" RETURNING "created_at", "namespace", "key"',
}
#: DjangoStore with each concurrent caller in its own ``ThreadSensitiveContext`` (see common.own_sync_thread).
OWN = "DjangoStore in own_thread()"
#: DjangoStore on its own async connections (``async_pool=True``): no thread hop.
POOLED = "DjangoStore(async_pool=True)"
#: DjangoStore on an alias with Django's server_side_binding and prepared statements.
PREPARED = f"DjangoStore {ON_PREPARED}"


def namespace(i: int) -> tuple[str, str, str]:
    return ("users", f"u{i % NAMESPACES:03d}", "memories")


def key(i: int, per_namespace: int) -> str:
    return f"k{(i // NAMESPACES) % per_namespace:04d}"


def value(i: int) -> dict[str, Any]:
    return {"text": f"the user mentioned fact number {i} in passing", "n": i, "tags": ["bench", "fact"]}


async def _load_django(items: int) -> None:
    from asgiref.sync import sync_to_async

    from afkmemory.stores import SyncDjangoStore

    def load() -> None:
        store = SyncDjangoStore()
        for i in range(items):
            store.put(namespace(i), key(i, items // NAMESPACES), value(i))

    await sync_to_async(load)()


async def run(scale: Scale, url: str) -> list[Result]:
    import asyncpg
    from agentflow.store.postgres import PostgresStore
    from langgraph.store.base import PutOp
    from langgraph.store.postgres.aio import AsyncPostgresStore

    from afkmemory.stores import DjangoStore, SyncDjangoStore

    items = scale.store_items
    per_ns = items // NAMESPACES
    async with contextlib.AsyncExitStack() as stack:
        pool = await asyncpg.create_pool(url, min_size=8, max_size=8)
        stack.push_async_callback(pool.close)
        agentflow = PostgresStore(pool=pool, table="agentflow_store")
        langgraph = await stack.enter_async_context(
            AsyncPostgresStore.from_conn_string(url, pool_config={"min_size": 8, "max_size": 8})
        )
        await langgraph.setup()
        django = DjangoStore()
        pooled = DjangoStore(async_pool=True)
        prepared = DjangoStore(using=PREPARED_ALIAS)
        sync_django = SyncDjangoStore()
        raw = await stack.enter_async_context(_RawStore(url))

        log.info("store: loading %d items into each implementation", items)
        await _load_django(items)
        for start in range(0, items, 500):
            batch = range(start, min(start + 500, items))
            # agentflow has no bulk put: its own statement, many rows per round trip.
            await agentflow.put(namespace(start), key(start, per_ns), value(start))  # creates the table
            await pool.executemany(
                "INSERT INTO agentflow_store (namespace, key, value) VALUES ($1, $2, $3::jsonb) "
                "ON CONFLICT (namespace, key) DO UPDATE SET value = EXCLUDED.value",
                [(list(namespace(i)), key(i, per_ns), json.dumps(value(i))) for i in batch],
            )
            await langgraph.abatch([PutOp(namespace(i), key(i, per_ns), value(i), index=False) for i in batch])
        async with pool.acquire() as conn:
            for table in ("agentflow_store", "store", "afkmemory_storeitem"):
                await conn.execute(f"VACUUM ANALYZE {table}")

        def ns(i: int) -> tuple[str, ...]:
            return namespace(i * 7919)

        def k(i: int) -> str:
            return key(i * 7919, per_ns)

        def page(i: int) -> dict[str, Any]:
            # A different page for each of 50 calls in a row: LangGraph's batching answers
            # identical reads in one batch with one query, so 8 concurrent calls of the same
            # listing would cost it one. Every page lists 50 of the 100 namespaces.
            return {"prefix": ("users",), "limit": 50, "offset": i % 50}

        cases: dict[str, dict[str, Any]] = {
            "put": {
                "DjangoStore": lambda i: django.put(ns(i), k(i), value(i)),
                OWN: lambda i: django.put(ns(i), k(i), value(i)),
                POOLED: lambda i: pooled.put(ns(i), k(i), value(i)),
                PREPARED: lambda i: prepared.put(ns(i), k(i), value(i)),
                RAW: lambda i: raw.put(ns(i), k(i), value(i)),
                "agentflow PostgresStore": lambda i: agentflow.put(ns(i), k(i), value(i)),
                "LangGraph AsyncPostgresStore": lambda i: langgraph.aput(ns(i), k(i), value(i), index=False),
                "SyncDjangoStore (threads)": lambda i: sync_django.put(ns(i), k(i), value(i)),
            },
            "get": {
                "DjangoStore": lambda i: django.get(ns(i), k(i)),
                OWN: lambda i: django.get(ns(i), k(i)),
                POOLED: lambda i: pooled.get(ns(i), k(i)),
                PREPARED: lambda i: prepared.get(ns(i), k(i)),
                RAW: lambda i: raw.get(ns(i), k(i)),
                "agentflow PostgresStore": lambda i: agentflow.get(ns(i), k(i)),
                "LangGraph AsyncPostgresStore": lambda i: langgraph.aget(ns(i), k(i)),
                "SyncDjangoStore (threads)": lambda i: sync_django.get(ns(i), k(i)),
            },
            "search (limit 50)": {
                "DjangoStore": lambda i: django.search(ns(i)[:2], limit=50),
                OWN: lambda i: django.search(ns(i)[:2], limit=50),
                POOLED: lambda i: pooled.search(ns(i)[:2], limit=50),
                PREPARED: lambda i: prepared.search(ns(i)[:2], limit=50),
                "agentflow PostgresStore": lambda i: agentflow.search(ns(i)[:2], limit=50),
                "LangGraph AsyncPostgresStore": lambda i: langgraph.asearch(ns(i)[:2], limit=50),
                "SyncDjangoStore (threads)": lambda i: sync_django.search(ns(i)[:2], limit=50),
            },
            "list_namespaces (50 at a rotating offset)": {
                "DjangoStore": lambda i: django.list_namespaces(**page(i)),
                OWN: lambda i: django.list_namespaces(**page(i)),
                POOLED: lambda i: pooled.list_namespaces(**page(i)),
                PREPARED: lambda i: prepared.list_namespaces(**page(i)),
                "agentflow PostgresStore": lambda i: agentflow.list_namespaces(**page(i)),
                "LangGraph AsyncPostgresStore": lambda i: langgraph.alist_namespaces(**page(i)),
                "SyncDjangoStore (threads)": lambda i: sync_django.list_namespaces(**page(i)),
            },
        }
        # Every implementation returns the same answer: compare once before timing.
        await _check_same_answers(cases, sync=("SyncDjangoStore (threads)",))
        results = []
        for case, impls in cases.items():
            results += await compare_async(
                "store",
                case,
                impls,
                ops=scale.store_ops,
                rounds=scale.rounds,
                sync=("SyncDjangoStore (threads)",),
                contexts={OWN: own_sync_thread},
                warmup=3 if scale.smoke else 30,
            )
        return results


class _RawStore:
    """DjangoStore's get and put as the statements it sends, on psycopg's async pool (autocommit).

    What any store built on psycopg could reach with one caller: the same SQL and the same
    ``Item``s, with no ORM, no thread hop and no validation. It sends one statement per call,
    also with 8 callers, where DjangoStore merges concurrent calls into one statement and
    one commit. ``_check_sql`` fails the run if DjangoStore's statements change.
    """

    def __init__(self, url: str) -> None:
        from psycopg_pool import AsyncConnectionPool

        self.pool = AsyncConnectionPool(url, min_size=8, max_size=8, open=False, kwargs={"autocommit": True})

    async def __aenter__(self) -> _RawStore:
        await self.pool.open(wait=True)
        await asyncio.to_thread(_check_sql)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pool.close()

    async def get(self, namespace: tuple[str, ...], key: str) -> Any:
        from datetime import UTC, datetime

        from agentflow.store.base import Item

        from afkmemory.namespaces import decode, encode

        async with self.pool.connection() as conn:
            cur = await conn.execute(SQL["get"], (datetime.now(UTC), key, encode(namespace)))
            row = await cur.fetchone()
        if row is None:
            return None
        ns, k, v, created, updated, expires = row
        iso = [None if t is None else t.astimezone(UTC).isoformat() for t in (created, updated, expires)]
        return Item(decode(ns), k, v, *iso)

    async def put(self, namespace: tuple[str, ...], key: str, value: Any) -> Any:
        from datetime import UTC, datetime

        from agentflow.store.base import Item
        from psycopg.types.json import Jsonb

        from afkmemory.namespaces import encode

        now = datetime.now(UTC)
        async with self.pool.connection() as conn:
            cur = await conn.execute(SQL["put"], (encode(namespace), key, Jsonb(value), now, now, None))
            created, _, _ = await cur.fetchone()
        return Item(namespace, key, value, created.astimezone(UTC).isoformat(), now.isoformat(), None)


def _check_sql() -> None:
    """Fail if DjangoStore no longer sends the statements the raw side replays."""
    from afkmemory.stores import SyncDjangoStore

    def calls() -> None:
        SyncDjangoStore().put(("check-sql",), "k", 1)
        SyncDjangoStore().get(("check-sql",), "k")

    check_replayed_sql("DjangoStore", SQL, calls)


async def _check_same_answers(cases: dict[str, dict[str, Any]], sync: tuple[str, ...]) -> None:
    def norm(case: str, got: Any) -> Any:
        if case.startswith("list_namespaces"):
            return sorted(tuple(n) for n in got)
        if case.startswith("search"):  # LangGraph orders by updated_at, the others by key
            return (len(got), {tuple(item.namespace) for item in got})
        if case == "get":
            return got.value
        return None  # put: LangGraph returns nothing; the get check reads what was written

    for case, impls in cases.items():
        for i in (12345, 12346, 12347, 12394):  # list_namespaces: offsets 45, 46, 47 and 44
            answers = {}
            for name, op in impls.items():
                got = await asyncio.to_thread(op, i) if name in sync else await op(i)
                answers[name] = norm(case, got)
            first = next(iter(answers.values()))
            for name, answer in answers.items():
                if answer != first:
                    raise AssertionError(f"store {case}, call {i}: {name} answered differently from the others")
