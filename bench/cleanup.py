"""Workload 4: compaction of a thread and a sweep of expired store items, 10,000 to 1,000,000 rows.

- Compaction: a thread of N events compacted to 500 (``compact_thread`` with
  ``RetentionPolicy(max_events_per_thread=500, keep_event_types=[])``).
- Sweep: N expired items among the store's live ones, reclaimed by
  ``SyncDjangoStore.sweep_expired()`` (batches of ``DELETE_BATCH_SIZE``), beside the
  one-statement ``DELETE ... WHERE expires_at <= now()`` that LangGraph's ``sweep_ttl``
  runs, on the same rows.

Each run records the total time, every statement's time (``common.StatementTimer``: each
statement Django executes, each FETCH and CLOSE of the server-side cursor compaction
streams ids through, each COMMIT), the longest one, and the longest transaction
(compaction: the whole call; a batched sweep: one batch, SELECT ... FOR UPDATE, DELETE and
COMMIT). Rows are loaded with COPY, untimed, then written out (``settle``), so the job
measured does not pay for the load's writes.

The largest compaction holds one transaction for seconds (row locks on the doomed events,
``FOR NO KEY UPDATE`` on the thread row); appends into that thread take ``FOR KEY SHARE``
through their foreign key and should never wait for it. While it runs, another thread
appends into the same thread (100 a second, its own connection) and the appends'
latencies are recorded; likewise puts into the store during the largest batched sweep.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import re
import time
from collections import Counter

from django.db import connection, transaction
from django.utils import timezone

from .common import StatementTimer, calls_meanwhile, latency_summary, psql
from .measure import Result, Scale
from .memory import BASE_TS, copy_events, payload

log = logging.getLogger("bench")


def _kind(sql: str) -> str:
    """Return a short label of a statement: its verb and its first table."""
    verb = sql.split(None, 1)[0].upper()
    table = re.search(r'(?:FROM|INTO|UPDATE)\s+"?(\w+)"?', sql)
    lock = " FOR UPDATE" if "FOR UPDATE" in sql or "FOR NO KEY UPDATE" in sql else ""
    return f"{verb} {table.group(1) if table else ''}{lock}".strip()


def _row(
    case: str, impl: str, rows: int, seconds: float, timer: StatementTimer | None, longest_tx: float, **extra: object
) -> Result:
    longest, sql = timer.longest if timer else (seconds, "DELETE")
    res = Result(
        workload="cleanup",
        case=case,
        impl=impl,
        mode=f"{rows}",
        ops_per_s=rows / seconds if seconds else 0.0,
        p50_ms=0.0,
        p99_ms=0.0,
        ops=rows,
        rounds=1,
        extra={
            "rows": rows,
            "total_s": round(seconds, 3),
            "us_per_row": round(seconds / rows * 1e6, 2),
            "longest_statement_ms": round(longest * 1000, 1),
            "longest_statement": _kind(sql),
            "statements": len(timer.statements) if timer else 1,
            "statements_by_kind": dict(Counter(_kind(sql) for _, sql in timer.statements)) if timer else {"DELETE": 1},
            "longest_transaction_ms": round(longest_tx * 1000, 1),
            **extra,
        },
    )
    log.info(
        "  cleanup    %-12s %-40s %9d rows  %7.2f s  %6.2f us/row  longest statement %7.1f ms (%s)",
        case,
        impl,
        rows,
        seconds,
        res.extra["us_per_row"],
        longest * 1000,
        _kind(sql),
    )
    return res


def compaction(rows: int, keep: int, *, appends_meanwhile: bool = False) -> Result:
    from afkmemory import models
    from afkmemory.memory.types import MemoryEvent, RetentionPolicy
    from afkmemory.stores import SyncDjangoMemoryStore

    thread_id = f"compact-{rows}"
    thread = models.Thread.objects.create(thread_id=thread_id)
    with transaction.atomic():
        copy_events(thread.pk, rows, prefix="c")
    settle("afkmemory_event")
    policy = RetentionPolicy(max_events_per_thread=keep, keep_event_types=[])
    store = SyncDjangoMemoryStore()

    def append(i: int) -> None:  # newer than every loaded event
        store.append_event(MemoryEvent(f"meanwhile-{i}", thread_id, "u1", "message", BASE_TS + 10**9 + i, payload(i)))

    with contextlib.ExitStack() as stack:
        appends = stack.enter_context(calls_meanwhile(append)) if appends_meanwhile else None
        with StatementTimer() as timer:
            t0 = time.perf_counter()
            result = store.compact_thread(thread_id, policy)
            seconds = time.perf_counter() - t0
    left = models.Event.objects.filter(thread=thread).count()
    appended = models.Event.objects.filter(thread=thread, event_id__startswith="meanwhile-").count()
    # The appends the compaction's snapshot saw are among the newest it kept; the others came after it.
    seen = result.events_before - rows
    assert result.events_after == keep and result.events_removed == result.events_before - keep, result
    assert left == keep + appended - seen, (left, appended, seen)
    made = len(appends) + 1 if appends is not None else 0  # with the untimed first append
    assert appended == made, "compaction deleted an event appended meanwhile"
    psql("DELETE FROM afkmemory_event WHERE thread_id = %s", [thread.pk])
    thread.delete()
    extra: dict[str, object] = {"events_after": left}
    if appends is not None:
        extra["appends_meanwhile"] = latency_summary(appends)
    return _row("compaction", f"compact_thread to {keep}", rows, seconds, timer, seconds, **extra)


def settle(table: str) -> None:
    """VACUUM ANALYZE the freshly loaded ``table``, then CHECKPOINT.

    A load of up to a million rows leaves gigabytes of dirty pages and WAL; without the
    checkpoint their write-out (a timed checkpoint, the background writer) lands inside
    the job measured next and stalls its statements on the disk (one run measured a
    500-row DELETE at 122 ms this way, another at 7 ms). CHECKPOINT needs a superuser
    or pg_checkpoint: on a server that refuses it, the load's writes stay in the figures.
    """
    from django.db import DatabaseError

    psql(f"VACUUM ANALYZE {table}")
    try:
        psql("CHECKPOINT")
    except DatabaseError as exc:
        log.warning("cleanup: CHECKPOINT refused (%s); the load's writes may slow the jobs measured", exc)


def load_expired(rows: int, tag: str) -> None:
    from afkmemory.namespaces import encode

    now = timezone.now()
    created, expired = now - dt.timedelta(hours=2), now - dt.timedelta(hours=1)
    with transaction.atomic():
        raw = connection.connection
        with (
            raw.cursor() as cur,
            cur.copy(
                "COPY afkmemory_storeitem (namespace, key, value, created_at, updated_at, expires_at) FROM STDIN"
            ) as copy,
        ):
            for i in range(rows):
                ns = encode(("sessions", tag, f"s{i // 1000}"))
                copy.write_row((ns, f"k{i}", json.dumps({"n": i}), created, created, expired))
    settle("afkmemory_storeitem")


def sweep(rows: int, *, puts_meanwhile: bool = False) -> list[Result]:
    from afkmemory import models
    from afkmemory.namespaces import encode
    from afkmemory.stores import SyncDjangoStore

    live = models.StoreItem.objects.count()
    load_expired(rows, f"batched{rows}")
    meanwhile = ("meanwhile", f"puts{rows}")

    def put(i: int) -> None:  # a live item of its own namespace, beside the expired ones
        SyncDjangoStore().put(meanwhile, f"k{i}", {"n": i})

    with contextlib.ExitStack() as stack:
        puts = stack.enter_context(calls_meanwhile(put)) if puts_meanwhile else None
        with StatementTimer() as timer:
            t0 = time.perf_counter()
            removed = SyncDjangoStore().sweep_expired(all_owners=True)
            seconds = time.perf_counter() - t0
    models.StoreItem.objects.filter(namespace=encode(meanwhile)).delete()
    assert removed == rows and models.StoreItem.objects.count() == live, (removed, rows)
    extra: dict[str, object] = {"live_items": live}
    if puts is not None:
        extra["puts_meanwhile"] = latency_summary(puts)
    longest_tx = max(timer.transactions(), default=0.0)
    out = [_row("sweep", "SyncDjangoStore.sweep_expired (batched)", rows, seconds, timer, longest_tx, **extra)]

    # LangGraph's sweep_ttl: one DELETE of everything expired, in one transaction.
    load_expired(rows, f"single{rows}")
    t0 = time.perf_counter()
    psql("DELETE FROM afkmemory_storeitem WHERE expires_at <= now()")
    seconds = time.perf_counter() - t0
    assert models.StoreItem.objects.count() == live
    out.append(_row("sweep", "one DELETE (LangGraph's sweep_ttl)", rows, seconds, None, seconds, live_items=live))
    psql("VACUUM ANALYZE afkmemory_storeitem")
    return out


def run(scale: Scale, url: str) -> list[Result]:
    from django.db import connections

    results = []
    for rows in scale.compaction_sizes:
        results.append(compaction(rows, scale.compaction_keep, appends_meanwhile=rows == max(scale.compaction_sizes)))
    for rows in scale.sweep_sizes:
        results += sweep(rows, puts_meanwhile=rows == max(scale.sweep_sizes))
    connections.close_all()
    return results
