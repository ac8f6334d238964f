"""Workload 2: AFK's MemoryStore — append_event and get_recent_events(50) on a 100,000-event thread.

DjangoMemoryStore (and SyncDjangoMemoryStore from threads, for reference) against the
same SQL written by hand on raw psycopg 3 (an async pool of 8 connections): the floor
for one caller, what the statements cost with no framework. Both work on the same thread
of the same table. The raw side runs the statements Django sends for a lone call
(``SQL`` below, checked against Django's captured queries before timing: one
``INSERT ... SELECT`` per append into an existing thread, one ``SELECT`` per read, each
in autocommit) and builds the same ``MemoryEvent`` objects. With 8 callers the raw rows
are per call and unbatched (8 statements, 8 commits), while DjangoMemoryStore merges
concurrent calls into one statement and one commit: not the same SQL there.
"DjangoMemoryStore on a prepared alias" is the default store on an alias with Django's
``server_side_binding`` and prepared statements (bench/settings.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from django.db import connection

from .common import PREPARED_ALIAS, check_replayed_sql, compare_async, own_sync_thread, psql
from .measure import Result, Scale
from .report import ON_PREPARED

log = logging.getLogger("bench")

THREAD = "bench-thread"
#: DjangoMemoryStore with each concurrent caller in its own ``ThreadSensitiveContext``.
OWN = "DjangoMemoryStore in own_thread()"
#: DjangoMemoryStore on its own async connections (``async_pool=True``): no thread hop.
POOLED = "DjangoMemoryStore(async_pool=True)"
#: DjangoMemoryStore on an alias with Django's server_side_binding and prepared statements.
PREPARED = f"DjangoMemoryStore {ON_PREPARED}"
TYPES = ("message", "tool_call", "tool_result", "message", "trace")

#: What DjangoMemoryStore sends, as psycopg statements (owner NULL: rows written from Python).
SQL = {
    "insert": 'INSERT INTO "afkmemory_event" ("thread_id", "event_id", "user_id", "type", "timestamp", "payload", '
    '"tags") SELECT "id", %s, %s, %s, %s, %s, %s FROM "afkmemory_thread" WHERE "owner_id" IS NULL AND '
    '"thread_id" = %s',
    "recent": 'SELECT "afkmemory_event"."event_id" AS "event_id", "afkmemory_event"."user_id" AS "user_id", '
    '"afkmemory_event"."type" AS "type", "afkmemory_event"."timestamp" AS "timestamp", '
    '"afkmemory_event"."payload" AS "payload", "afkmemory_event"."tags" AS "tags" FROM "afkmemory_event" '
    'WHERE "afkmemory_event"."thread_id" = (SELECT U0."id" AS "pk" FROM "afkmemory_thread" U0 '
    'WHERE (U0."owner_id" IS NULL AND U0."thread_id" = %s) LIMIT 1) '
    'ORDER BY 4 DESC, "afkmemory_event"."id" DESC LIMIT %s',
}

BASE_TS = 1_700_000_000_000


def payload(i: int) -> dict[str, Any]:
    return {"role": "user", "content": f"message number {i}: what did we decide about the quarterly plan?"}


def copy_events(thread_pk: int, count: int, *, prefix: str = "e", start: int = 0) -> None:
    """Bulk-load ``count`` events into a thread with COPY (the loading is not what is measured)."""
    raw = connection.connection  # psycopg connection under Django's
    with (
        raw.cursor() as cur,
        cur.copy(
            'COPY afkmemory_event (thread_id, event_id, user_id, type, "timestamp", payload, tags) FROM STDIN'
        ) as copy,
    ):
        for i in range(start, start + count):
            copy.write_row(
                (thread_pk, f"{prefix}{i}", "u1", TYPES[i % len(TYPES)], BASE_TS + i, json.dumps(payload(i)), "[]")
            )


def make_thread(thread_id: str, events: int) -> int:
    from afkmemory import models

    thread = models.Thread.objects.create(thread_id=thread_id)
    from django.db import transaction

    with transaction.atomic():
        copy_events(thread.pk, events)
    psql("ANALYZE afkmemory_event")
    psql("ANALYZE afkmemory_thread")
    return thread.pk


async def run(scale: Scale, url: str) -> list[Result]:
    from asgiref.sync import sync_to_async
    from psycopg.types.json import Jsonb
    from psycopg_pool import AsyncConnectionPool

    from afkmemory.memory.types import MemoryEvent
    from afkmemory.stores import DjangoMemoryStore, SyncDjangoMemoryStore

    log.info("memory: loading a thread of %d events", scale.thread_events)
    await sync_to_async(make_thread)(THREAD, scale.thread_events)
    await sync_to_async(_check_sql)()

    async with contextlib.AsyncExitStack() as stack:
        # Autocommit, as Django runs outside a transaction: one statement, one round trip.
        pool = AsyncConnectionPool(url, min_size=8, max_size=8, open=False, kwargs={"autocommit": True})
        await pool.open(wait=True)
        stack.push_async_callback(pool.close)
        django = DjangoMemoryStore()
        pooled = DjangoMemoryStore(async_pool=True)
        prepared = DjangoMemoryStore(using=PREPARED_ALIAS)
        sync_django = SyncDjangoMemoryStore()

        def event(tag: str, i: int) -> MemoryEvent:
            return MemoryEvent(f"{tag}-{i}", THREAD, "u1", TYPES[i % len(TYPES)], BASE_TS + 10_000_000 + i, payload(i))

        async def raw_append(i: int) -> None:
            e = event("raw", i)
            async with pool.connection() as conn:
                cur = await conn.execute(
                    SQL["insert"], (e.id, e.user_id, e.type, e.timestamp, Jsonb(e.payload), Jsonb(e.tags), e.thread_id)
                )
                assert cur.rowcount == 1

        async def raw_recent(i: int) -> list[MemoryEvent]:
            async with pool.connection() as conn:
                cur = await conn.execute(SQL["recent"], (THREAD, 50))
                rows = await cur.fetchall()
            return [MemoryEvent(r[0], THREAD, r[1], r[2], r[3], r[4], r[5]) for r in reversed(rows)]

        recent_django = await django.get_recent_events(THREAD, 50)
        recent_raw = await raw_recent(0)
        assert recent_django == recent_raw, "raw psycopg and DjangoMemoryStore disagree on get_recent_events"
        assert await pooled.get_recent_events(THREAD, 50) == recent_raw, "the pooled store disagrees"
        assert await prepared.get_recent_events(THREAD, 50) == recent_raw, "the prepared alias disagrees"

        cases = {
            "append_event": {
                "DjangoMemoryStore": lambda i: django.append_event(event("dj", i)),
                OWN: lambda i: django.append_event(event("own", i)),
                POOLED: lambda i: pooled.append_event(event("pool", i)),
                PREPARED: lambda i: prepared.append_event(event("prep", i)),
                "raw psycopg (same SQL)": raw_append,
                "SyncDjangoMemoryStore (threads)": lambda i: sync_django.append_event(event("sdj", i)),
            },
            "get_recent_events(50)": {
                "DjangoMemoryStore": lambda i: django.get_recent_events(THREAD, 50),
                OWN: lambda i: django.get_recent_events(THREAD, 50),
                POOLED: lambda i: pooled.get_recent_events(THREAD, 50),
                PREPARED: lambda i: prepared.get_recent_events(THREAD, 50),
                "raw psycopg (same SQL)": raw_recent,
                "SyncDjangoMemoryStore (threads)": lambda i: sync_django.get_recent_events(THREAD, 50),
            },
        }
        results = []
        for case, impls in cases.items():
            results += await compare_async(
                "memory",
                case,
                impls,
                ops=scale.memory_ops,
                rounds=scale.rounds,
                sync=("SyncDjangoMemoryStore (threads)",),
                contexts={OWN: own_sync_thread},
                warmup=3 if scale.smoke else 30,
            )
        return results


def _check_sql() -> None:
    """Fail if DjangoMemoryStore no longer sends the statements the raw side replays."""
    from afkmemory.memory.types import MemoryEvent
    from afkmemory.stores import SyncDjangoMemoryStore

    store = SyncDjangoMemoryStore()

    def calls() -> None:
        store.append_event(MemoryEvent("check-sql", THREAD, "u1", "message", BASE_TS - 1, payload(0)))
        store.get_recent_events(THREAD, 50)

    sent = check_replayed_sql("DjangoMemoryStore", SQL, calls)
    log.info("memory: DjangoMemoryStore sends %d statements per append+read: %s", len(sent), [s[:60] for s in sent])
