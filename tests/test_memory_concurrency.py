"""Compaction racing appends from other processes loses nothing, on SQLite and PostgreSQL."""

from __future__ import annotations

import time

import pytest

from afkmemory.memory import MemoryEvent, RetentionPolicy, compact_thread
from afkmemory.stores import DjangoMemoryStore, SyncDjangoMemoryStore
from tests.utils import in_processes, run

APPENDERS = 2
TRACES_EACH = 120
OLD_MESSAGES = 3000
BUDGET = APPENDERS * TRACES_EACH + 10
POLICY = RetentionPolicy(max_events_per_thread=BUDGET, keep_event_types=["trace"])


def append_traces(alias: str, worker: int, start_at: float) -> list[str]:
    """Append protected trace events one by one, as an agent would while compaction runs."""
    from asgiref.sync import async_to_sync

    store = DjangoMemoryStore(using=alias)
    time.sleep(max(0.0, start_at - time.time()))
    written = []
    for i in range(TRACES_EACH):
        event = MemoryEvent(f"w{worker}-{i}", "busy", None, "trace", 10_000 + i, {"worker": worker}, [])
        async_to_sync(store.append_event)(event)
        written.append(event.id)
    return written


def compact_until_done(alias: str, start_at: float, rounds: int) -> list[int]:
    """Compact the thread again and again while the appenders run; also refill old messages."""
    from asgiref.sync import async_to_sync

    store = DjangoMemoryStore(using=alias)
    time.sleep(max(0.0, start_at - time.time()))
    removed = []
    for r in range(rounds):
        result = async_to_sync(compact_thread)(store, thread_id="busy", event_policy=POLICY)
        removed.append(result.events_removed)
        for i in range(20):  # unprotected filler, so every round has something to remove
            event = MemoryEvent(f"r{r}-{i}", "busy", None, "message", i, {}, [])
            async_to_sync(store.append_event)(event)
    return removed


@pytest.mark.slow
@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@pytest.mark.parametrize("alias", ["default", "postgres"])
def test_compaction_never_deletes_events_appended_meanwhile(alias):
    store = DjangoMemoryStore(using=alias)
    run(store.replace_thread_events(
        "busy", [MemoryEvent(f"old{i}", "busy", None, "message", i, {}, []) for i in range(OLD_MESSAGES)]
    ))  # fmt: skip
    start_at = time.time() + 3  # the children need a moment to start Django
    args = [(alias, w, start_at) for w in range(APPENDERS)]
    results = in_processes(_dispatch, [("append", a) for a in args] + [("compact", (alias, start_at, 25))])
    appended = [eid for r in results[:APPENDERS] for eid in r]
    removed = results[-1]

    remaining = {e.id for e in run(store.get_recent_events("busy", limit=100_000))}
    lost = [eid for eid in appended if eid not in remaining]
    assert lost == [], f"compaction deleted {len(lost)} events appended while it ran"
    assert len(appended) == APPENDERS * TRACES_EACH
    assert removed[0] >= OLD_MESSAGES - BUDGET  # the first round did cut the old history

    # Once the appenders are done, one more compaction brings the thread within budget.
    run(compact_thread(store, thread_id="busy", event_policy=POLICY))
    final = run(store.get_recent_events("busy", limit=100_000))
    assert {e.id for e in final if e.type == "trace"} == set(appended)
    assert len(final) == BUDGET


def _dispatch(kind: str, args: tuple) -> object:
    return append_traces(*args) if kind == "append" else compact_until_done(*args)


@pytest.mark.django_db(databases=["postgres"], transaction=True)
def test_a_back_dated_append_committed_mid_compaction_survives():
    """An event older than the scan window, committed after compaction read its ids, stays.

    The append is injected, from another connection, right after the compaction's SELECT
    of the thread's events runs: deterministic, where the process race above is not.
    """
    import threading

    from django.db import connections

    store = DjangoMemoryStore(using="postgres")
    run(store.replace_thread_events(
        "t", [MemoryEvent(f"old{i}", "t", None, "message", 100 + i, {}, []) for i in range(20)]
    ))  # fmt: skip
    injected = []

    def append_elsewhere() -> None:
        late = MemoryEvent("late", "t", None, "trace", 1, {}, [])  # older than every event
        SyncDjangoMemoryStore(using="postgres").append_event(late)
        connections["postgres"].close()
        injected.append(late.id)

    def after_the_read(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if not injected and 'FROM "afkmemory_event"' in sql and sql.lstrip().startswith(("SELECT", "DECLARE")):
            worker = threading.Thread(target=append_elsewhere)
            worker.start()
            worker.join()
        return result

    policy = RetentionPolicy(max_events_per_thread=3, keep_event_types=[], scan_limit=5)
    with connections["postgres"].execute_wrapper(after_the_read):
        result = SyncDjangoMemoryStore(using="postgres").compact_thread("t", policy)
    assert injected == ["late"]
    remaining = [e.id for e in run(store.get_recent_events("t", 100))]
    assert remaining == ["late", "old17", "old18", "old19"]
    assert (result.events_before, result.events_removed) == (20, 17)
