"""Workload 1: agentflow's Store — put, get, search and list_namespaces over 10,000 items.

DjangoStore (and SyncDjangoStore from threads, for reference) against agentflow's own
``PostgresStore`` (asyncpg) and LangGraph's ``AsyncPostgresStore`` (psycopg 3 pool).
Every implementation holds the same items: 100 namespaces ``("users", "uNNN",
"memories")`` of 100 keys each. ``put`` overwrites an existing key (the table stays at
its size), ``search`` asks one user's namespace for 50 items, ``list_namespaces`` lists
the 100 namespaces under ``("users",)``. Peers get a pool of 8 connections, one per
concurrent caller. "DjangoStore in own_thread()" is the same store with each
caller inside asgiref's ``ThreadSensitiveContext``, as Django's ASGI handler runs a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from .common import compare_async, own_sync_thread
from .measure import Result, Scale

log = logging.getLogger("bench")

NAMESPACES = 100
#: DjangoStore with each concurrent caller in its own ``ThreadSensitiveContext`` (see common.own_sync_thread).
OWN = "DjangoStore in own_thread()"


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
        sync_django = SyncDjangoStore()

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

        cases: dict[str, dict[str, Any]] = {
            "put": {
                "DjangoStore": lambda i: django.put(ns(i), k(i), value(i)),
                OWN: lambda i: django.put(ns(i), k(i), value(i)),
                "agentflow PostgresStore": lambda i: agentflow.put(ns(i), k(i), value(i)),
                "LangGraph AsyncPostgresStore": lambda i: langgraph.aput(ns(i), k(i), value(i), index=False),
                "SyncDjangoStore (threads)": lambda i: sync_django.put(ns(i), k(i), value(i)),
            },
            "get": {
                "DjangoStore": lambda i: django.get(ns(i), k(i)),
                OWN: lambda i: django.get(ns(i), k(i)),
                "agentflow PostgresStore": lambda i: agentflow.get(ns(i), k(i)),
                "LangGraph AsyncPostgresStore": lambda i: langgraph.aget(ns(i), k(i)),
                "SyncDjangoStore (threads)": lambda i: sync_django.get(ns(i), k(i)),
            },
            "search (limit 50)": {
                "DjangoStore": lambda i: django.search(ns(i)[:2], limit=50),
                OWN: lambda i: django.search(ns(i)[:2], limit=50),
                "agentflow PostgresStore": lambda i: agentflow.search(ns(i)[:2], limit=50),
                "LangGraph AsyncPostgresStore": lambda i: langgraph.asearch(ns(i)[:2], limit=50),
                "SyncDjangoStore (threads)": lambda i: sync_django.search(ns(i)[:2], limit=50),
            },
            "list_namespaces": {
                "DjangoStore": lambda i: django.list_namespaces(prefix=("users",), limit=100),
                OWN: lambda i: django.list_namespaces(prefix=("users",), limit=100),
                "agentflow PostgresStore": lambda i: agentflow.list_namespaces(prefix=("users",), limit=100),
                "LangGraph AsyncPostgresStore": lambda i: langgraph.alist_namespaces(prefix=("users",), limit=100),
                "SyncDjangoStore (threads)": lambda i: sync_django.list_namespaces(prefix=("users",), limit=100),
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
                warmup=10 if scale.smoke else 30,
            )
        return results


async def _check_same_answers(cases: dict[str, dict[str, Any]], sync: tuple[str, ...]) -> None:
    def norm(case: str, got: Any) -> Any:
        if case == "list_namespaces":
            return sorted(tuple(n) for n in got)
        if case.startswith("search"):  # LangGraph orders by updated_at, the others by key
            return (len(got), {tuple(item.namespace) for item in got})
        if case == "get":
            return got.value
        return None  # put: LangGraph returns nothing; the get check reads what was written

    for case, impls in cases.items():
        answers = {}
        for name, op in impls.items():
            got = await asyncio.to_thread(op, 12345) if name in sync else await op(12345)
            answers[name] = norm(case, got)
        first = next(iter(answers.values()))
        for name, answer in answers.items():
            if answer != first:
                raise AssertionError(f"store {case}: {name} answered differently from the others")
