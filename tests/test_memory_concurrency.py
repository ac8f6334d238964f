"""Compaction racing appends from other processes loses nothing, on SQLite and PostgreSQL."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
from django.db import connections

from afkmemory.memory import MemoryEvent, RetentionPolicy, StateRetentionPolicy, compact_thread
from afkmemory.stores import DjangoMemoryStore, SyncDjangoMemoryStore, bulk
from afkmemory.stores import memory as memory_stores
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


#: Ten trace events, then twenty messages; the window is the messages, and keeps the newest five.
#: Protected traces stand just behind it, so a window reaching back keeps them instead.
INTERRUPTED_THREAD = [("trace", i) for i in range(10)] + [("message", i) for i in range(10, 30)]
INTERRUPTED_POLICY = RetentionPolicy(max_events_per_thread=5, keep_event_types=["trace"], scan_limit=20)


@pytest.mark.parametrize("alias", ["default", "postgres"])
@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
def test_a_compaction_interrupted_between_batches_then_run_again_keeps_what_one_run_keeps(alias, settings, monkeypatch):
    """Killed after its first batch of deletes, then run again: the newest five messages, as one
    run leaves. The window's dropped events used to go first, so on SQLite (a transaction a
    batch) the second run's window reached back to the traces and kept them instead of the
    newest messages. On PostgreSQL the interrupted run deletes nothing (one transaction)."""
    settings.AFKMEMORY = {**settings.AFKMEMORY, "DELETE_BATCH_SIZE": 2}
    store = SyncDjangoMemoryStore(using=alias)
    store.replace_thread_events(
        "t1", [MemoryEvent(f"e{i}", "t1", None, kind, i, {}, []) for kind, i in INTERRUPTED_THREAD]
    )
    delete = bulk.DeleteByPk.__call__

    def killed_after_the_first_batch(self, batch):
        if calls:
            raise KeyboardInterrupt("killed")
        calls.append(batch)
        return delete(self, batch)

    calls: list[list[int]] = []
    monkeypatch.setattr(bulk.DeleteByPk, "__call__", killed_after_the_first_batch)
    with pytest.raises(KeyboardInterrupt):
        store.compact_thread("t1", INTERRUPTED_POLICY)
    monkeypatch.undo()
    left = len(store.get_recent_events("t1", limit=100))
    assert left == (28 if connections[alias].vendor == "sqlite" else 30)
    store.compact_thread("t1", INTERRUPTED_POLICY)
    assert [e.id for e in store.get_recent_events("t1", limit=100)] == [f"e{i}" for i in range(25, 30)]


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


# -- pruning old runs' state while a run writes -------------------------------------------------

PRUNE_OLD_RUNS = StateRetentionPolicy(max_runs=1)


def _two_runs(store) -> None:
    """Run "old" checkpointed first, "new" after: a one-run policy drops "old"."""
    run(store.write_checkpoint("t", "old", 1, "pre_llm", {"n": 1}))
    time.sleep(0.01)  # the pointers' timestamps differ
    run(store.write_checkpoint("t", "new", 1, "pre_llm", {"n": 1}))


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@pytest.mark.parametrize("alias", ["default", "postgres"])
def test_a_checkpoint_written_while_old_runs_are_pruned_is_kept(alias, monkeypatch):
    """The old run resumes between the prune's read and its deletes: its new latest pointer survives.

    The resumed run writes from another thread and connection while the prune decides.
    The prune then finds a row it meant to delete rewritten, deletes nothing, and decides
    again on what is there now: the resumed run is the newest, so "new" goes (as on Redis).
    """
    store = DjangoMemoryStore(using=alias)
    _two_runs(store)
    writer: list[threading.Thread] = []
    decisions: list[list[str]] = []
    real = memory_stores.doomed_state

    def decide_while_the_run_resumes(state, policy):
        decisions.append(sorted(state))
        if not writer:

            def resume() -> None:
                try:
                    SyncDjangoMemoryStore(using=alias).write_checkpoint("t", "old", 5, "pre_llm", {"resumed": True})
                finally:
                    connections[alias].close()

            writer.append(threading.Thread(target=resume))
            writer[0].start()
            writer[0].join(30)  # nothing is locked while the prune decides: the run does not wait
            assert not writer[0].is_alive()
        return real(state, policy)

    monkeypatch.setattr(memory_stores, "doomed_state", decide_while_the_run_resumes)
    result = run(compact_thread(store, thread_id="t", state_policy=PRUNE_OLD_RUNS))
    assert len(decisions) == 2 and len(decisions[1]) == len(decisions[0]) + 1  # decided again, on the new rows
    assert result.state_keys_removed == 2  # new's checkpoint and pointer
    latest = run(store.latest_checkpoint("t", "old"))
    assert latest is not None and latest.step == 5 and latest.payload == {"resumed": True}
    assert run(store.latest_checkpoint("t", "new")) is None


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@pytest.mark.parametrize("alias", ["default", "postgres"])
def test_a_prune_whose_rows_change_under_every_decision_gives_up_removing_nothing(alias, monkeypatch):
    """As the README says: after PRUNE_ATTEMPTS decisions, each finding a row it meant to delete
    rewritten (runs of the thread writing all the while), a RuntimeError, and nothing removed."""
    store = DjangoMemoryStore(using=alias)
    _two_runs(store)
    before = run(store.list_state("t"))
    resumes: list[int] = []
    real = memory_stores.doomed_state

    def a_run_writes_again(state, policy):  # after each read, before the locked read again
        doomed = real(state, policy)
        resumes.append(len(resumes))
        run_id = min(doomed).split(":")[1]  # the run the prune would drop writes again: now the newest
        SyncDjangoMemoryStore(using=alias).write_checkpoint("t", run_id, 1, "pre_llm", {"again": len(resumes)})
        return doomed

    monkeypatch.setattr(memory_stores, "doomed_state", a_run_writes_again)
    with pytest.raises(RuntimeError, match="changed under 5 attempts"):
        run(store.compact_state("t", PRUNE_OLD_RUNS))
    assert len(resumes) == memory_stores.PRUNE_ATTEMPTS == 5
    after = run(store.list_state("t"))
    assert after.keys() == before.keys()  # rewritten, not removed


@pytest.mark.django_db(databases=["postgres"], transaction=True)
def test_a_live_runs_checkpoint_writes_do_not_wait_for_a_prune_nor_deadlock_with_it(monkeypatch):
    """The prune locks only the rows it deletes, in the order writes take them (pointer, then checkpoint)."""
    alias = "postgres"
    store = SyncDjangoMemoryStore(using=alias)
    for run_index in range(3):
        store.write_checkpoint("t", f"run-{run_index}", 0, "pre_llm", {})
        store.put_state_many("t", {f"effect:run-{run_index}:0:call-{i}": {"output": i} for i in range(300)})
        time.sleep(0.002)
    waited: list[float] = []
    real = memory_stores.DeleteByPk.__call__

    def delete_while_the_live_run_writes(self, ids):
        if not waited:  # inside the prune's transaction, its doomed rows locked

            def write() -> None:
                try:
                    started = time.monotonic()
                    SyncDjangoMemoryStore(using=alias).write_checkpoint("t", "run-2", 1, "pre_llm", {"live": True})
                    waited.append(time.monotonic() - started)
                finally:
                    connections[alias].close()

            live = threading.Thread(target=write)
            live.start()
            live.join(30)
            assert waited, "the live run's write did not finish while the prune held its locks"
        return real(self, ids)

    monkeypatch.setattr(memory_stores.DeleteByPk, "__call__", delete_while_the_live_run_writes)
    before, removed = store.compact_state("t", StateRetentionPolicy(max_runs=1))
    assert removed == 2 * (2 + 300)  # run-0 and run-1: checkpoint, pointer and effects
    assert store.latest_checkpoint("t", "run-2").payload == {"live": True}


def _waiting_on_a_lock(monitor) -> int:
    """How many other backends of the test database wait for a lock."""
    with monitor.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


def _queued_behind_a_held_row(alias: str, hold: str, first, second) -> list[Exception]:
    """Run ``first`` then ``second``, each on its own thread, queued in that order behind a row
    another connection holds (``hold``: a ``SELECT ... FOR UPDATE``); then let the row go.
    Return what they raised."""
    errors: list[Exception] = []

    def on_its_own_connection(work) -> None:
        try:
            work()
        except Exception as error:
            errors.append(error)
        finally:
            connections[alias].close()

    holder, monitor = connections.create_connection(alias), connections.create_connection(alias)
    try:
        with holder.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute(hold)
        threads = []
        for waiting, work in enumerate((first, second), start=1):
            threads.append(threading.Thread(target=on_its_own_connection, args=(work,)))
            threads[-1].start()
            deadline = time.monotonic() + 30
            while _waiting_on_a_lock(monitor) < waiting:
                assert time.monotonic() < deadline, f"{work.__name__} never waited for a lock"
                time.sleep(0.01)
        with holder.cursor() as cursor:
            cursor.execute("COMMIT")
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive()
    finally:
        holder.close()
        monitor.close()
    return errors


@pytest.mark.django_db(databases=["postgres"], transaction=True)
@pytest.mark.parametrize("write", ["put_state_many", "delete_state_many"])
def test_a_write_of_several_rows_and_a_prune_of_them_lock_in_one_order(write):
    """Within a table, a prune locked its rows by primary key, writes and deletes by key: an old
    run's effects ``b`` then ``a`` (so b's row comes first) met a resumed run rewriting a and b
    in opposite orders, and PostgreSQL aborted one with "deadlock detected". Now every one of
    them takes a table's rows in the order of their identity (text compared byte by byte).

    Another connection holds row ``a`` so the two queue in a known order: the writer waits for
    a, then the prune takes what it takes before waiting for a too; then a is let go."""
    alias = "postgres"
    store = SyncDjangoMemoryStore(using=alias)
    store.write_checkpoint("t", "run-0", 0, "pre_llm", {})
    for tool_call in ("b", "a"):
        store.put_state("t", f"effect:run-0:0:{tool_call}", {"output": tool_call})
    time.sleep(0.002)
    store.write_checkpoint("t", "run-1", 0, "pre_llm", {})
    keys = ["effect:run-0:0:a", "effect:run-0:0:b"]

    def resumed_run() -> None:
        writer = SyncDjangoMemoryStore(using=alias)
        if write == "put_state_many":
            writer.put_state_many("t", {key: {"output": "again"} for key in keys})
        else:
            writer.delete_state_many("t", keys)

    def prune() -> None:
        outcome["pruned"] = SyncDjangoMemoryStore(using=alias).compact_state("t", StateRetentionPolicy(max_runs=1))

    outcome: dict[str, object] = {}
    hold = "SELECT 1 FROM afkmemory_effect WHERE run_id = 'run-0' AND tool_call_id = 'a' FOR UPDATE"
    assert _queued_behind_a_held_row(alias, hold, resumed_run, prune) == []
    # run-0's checkpoint and pointer, and its two effects unless the writer deleted them
    assert outcome["pruned"][1] == (4 if write == "put_state_many" else 2)
    run_0_state = {key for key in store.list_state("t") if ":run-0:" in key}
    assert run_0_state == set()  # decided again after the writer: run-0 is still the old run


@pytest.mark.django_db(databases=["postgres"], transaction=True)
def test_an_append_to_several_threads_and_a_delete_of_them_lock_in_one_order():
    """``append_events`` locked its threads in the order of its events, a delete of several
    threads by primary key: events for ``b`` then ``a`` (a made first) met a delete of both, and
    PostgreSQL aborted one with "deadlock detected". Now the append locks them in one statement,
    in primary key order too. Another connection holds ``b`` so the two queue in a known order."""
    from afkmemory import models

    alias = "postgres"
    store = SyncDjangoMemoryStore(using=alias)
    for thread_id in ("a", "b"):
        store.append_event(MemoryEvent("first", thread_id, None, "message", 0, {}, []))

    def append() -> None:
        SyncDjangoMemoryStore(using=alias).append_events(
            [MemoryEvent("late", thread_id, None, "message", 1, {}, []) for thread_id in ("b", "a")]
        )

    def delete() -> None:
        models.Thread.objects.using(alias).filter(thread_id__in=["a", "b"]).delete()

    hold = "SELECT 1 FROM afkmemory_thread WHERE thread_id = 'b' FOR UPDATE"
    assert _queued_behind_a_held_row(alias, hold, append, delete) == []
    assert not models.Thread.objects.using(alias).exists()  # deleted after the append, with its events
    assert not models.Event.objects.using(alias).exists()


def test_redis_prunes_from_a_fresh_read_when_a_run_writes_meanwhile(request, monkeypatch):
    """The old run resumes between the prune's read and its deletes: WATCH refuses the deletes, and
    the prune decides again on what is there now (the resumed run is the newest: "new" goes)."""
    import redis

    from afkmemory.memory import redis as redis_backend
    from afkmemory.memory.journal import checkpoint_entries
    from afkmemory.memory.types import dumps, now_ms
    from tests.redis_server import redis_memory_store

    store = redis_memory_store(request)
    _two_runs(store)
    real, reads = redis_backend.doomed_state, []

    def decide_while_the_run_resumes(state, policy):
        reads.append(sorted(state))
        if len(reads) == 1:  # what write_checkpoint writes, from another client
            time.sleep(0.01)
            _, entries = checkpoint_entries("t", "old", 5, "pre_llm", {"resumed": True}, now_ms())
            with redis.Redis.from_url(store.url) as client:
                client.hset(f"{store.key_prefix}st:t", mapping={key: dumps(value) for key, value in entries.items()})
        return real(state, policy)

    monkeypatch.setattr(redis_backend, "doomed_state", decide_while_the_run_resumes)
    result = run(compact_thread(store, thread_id="t", state_policy=PRUNE_OLD_RUNS))
    assert len(reads) == 2 and len(reads[1]) == len(reads[0]) + 1  # decided again, on the resumed run's writes
    assert result.state_keys_removed == 2
    latest = run(store.latest_checkpoint("t", "old"))
    assert latest is not None and latest.step == 5
    assert run(store.latest_checkpoint("t", "new")) is None


# -- a thread deleted while a write to it is under way ------------------------------------------


@pytest.mark.django_db(databases=["postgres"], transaction=True)
@pytest.mark.parametrize("write", ["put_state", "checkpoint", "append_events"])
def test_a_thread_deleted_during_a_write_waits_for_it_and_takes_the_write_along(write, monkeypatch):
    """The delete (the API's DELETE threads/{id}/, the admin) lands after the write commits, not
    under it: without the thread's lock the write failed at commit with a foreign key error."""
    from agentflow.checkpoint import Checkpoint

    from afkmemory import models
    from afkmemory.querysets import ThreadQuerySet
    from afkmemory.stores import SyncDjangoCheckpointer

    alias = "postgres"
    memory, saver = SyncDjangoMemoryStore(using=alias), SyncDjangoCheckpointer(using=alias)
    memory.put_state("t", "first", 1)
    deleter: list[threading.Thread] = []
    real = ThreadQuerySet.for_write_many  # what for_write calls too

    def delete_meanwhile(self, owner, thread_ids):
        threads = real(self, owner, thread_ids)
        if not deleter:

            def delete() -> None:
                try:
                    models.Thread.objects.using(alias).filter(thread_id="t").delete()
                finally:
                    connections[alias].close()

            deleter.append(threading.Thread(target=delete))
            deleter[0].start()
            deleter[0].join(0.5)  # it waits for this write's transaction
            assert deleter[0].is_alive()
        return threads

    monkeypatch.setattr(ThreadQuerySet, "for_write_many", delete_meanwhile)
    if write == "put_state":
        memory.put_state_many("t", {"second": 2, "third": 3})
    elif write == "append_events":  # the API's batch of events
        memory.append_events([MemoryEvent(f"e{i}", "t", None, "message", i, {}, []) for i in range(2)])
    else:
        saver.put(Checkpoint(thread="t", step=1, state={"n": 1}, ts="2026-01-01T00:00:00+00:00"))
    deleter[0].join(30)
    assert not deleter[0].is_alive()
    assert not models.Thread.objects.using(alias).exists()  # deleted after, with what was written
    assert memory.list_state("t") == {} and saver.get("t") is None and memory.get_recent_events("t") == []


@pytest.mark.django_db(databases=["postgres"], transaction=True)
def test_an_append_racing_its_threads_delete_lands_in_the_thread_made_anew():
    """The append's one statement reads the thread, then its foreign key check waits for the delete:
    the event is not lost with an IntegrityError, it starts the thread again."""
    from django.db import transaction

    from afkmemory import models

    alias = "postgres"
    store = SyncDjangoMemoryStore(using=alias)
    store.append_event(MemoryEvent("e1", "t", None, "message", 1, {}, []))
    locked = threading.Event()

    def delete_slowly() -> None:
        try:
            with transaction.atomic(using=alias):
                models.Thread.objects.using(alias).select_for_update().filter(thread_id="t").exists()
                locked.set()
                time.sleep(0.5)  # the append reads the thread meanwhile, and waits on its foreign key
                models.Thread.objects.using(alias).filter(thread_id="t").delete()
        finally:
            connections[alias].close()

    deleter = threading.Thread(target=delete_slowly)
    deleter.start()
    assert locked.wait(10)
    store.append_event(MemoryEvent("e2", "t", None, "message", 2, {}, []))
    deleter.join(30)
    assert [e.id for e in store.get_recent_events("t")] == ["e2"]  # e1 went with the old thread


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("alias", ["default", "postgres"])
def test_threads_chosen_by_a_grouped_or_joined_query_can_be_deleted(alias):
    """Deleting threads locks them first; a grouped, DISTINCT or joined queryset is locked through its keys."""
    from django.db.models import Count

    from afkmemory import models

    store = SyncDjangoMemoryStore(using=alias)
    for thread, count in (("busy", 3), ("quiet", 1)):
        for i in range(count):
            store.append_event(MemoryEvent(f"e{i}", thread, None, "message", i, {}, []))
    threads = models.Thread.objects.using(alias)
    assert threads.annotate(n=Count("events")).filter(n__gt=2).delete()[0] == 4  # the thread and its 3 events
    assert threads.filter(events__type="message").distinct().delete()[0] == 2
    assert not threads.exists() and not models.Event.objects.using(alias).exists()


@pytest.mark.django_db(databases=["postgres"], transaction=True)
@pytest.mark.parametrize("write", ["put_state", "append_events", "new thread"])
def test_an_account_deleted_while_its_agent_writes_goes_with_what_it_wrote(write, django_user_model):
    """Django's collector lists the account's threads before deleting them: a write under way to
    one of them, or a thread made meanwhile, failed the account's delete at commit with a foreign
    key error. Now the delete waits for writes to its threads and takes them along, and takes
    every thread of the account, whenever made."""
    from django.db import transaction
    from django.db.models.deletion import Collector

    from afkmemory import models

    alias = "postgres"
    users = django_user_model.objects.db_manager(alias)
    user = users.create(username="leaving")
    store = SyncDjangoMemoryStore(owner=user, using=alias)
    store.put_state("t", "first", 1)
    writing, release = threading.Event(), threading.Event()

    def agent() -> None:  # writes under the account's thread, in a transaction still open when the delete starts
        try:
            with transaction.atomic(using=alias):
                if write == "put_state":
                    store.put_state("t", "second", 2)
                else:
                    store.append_events([MemoryEvent(f"e{i}", "t", None, "message", i, {}, []) for i in range(2)])
                writing.set()
                release.wait(30)
        finally:
            connections[alias].close()

    real_delete = Collector.delete

    made: list[threading.Thread] = []

    def made_after_listing(self):  # a thread made for the account after the collector listed its rows
        if write == "new thread" and not made:  # once: the threads' own delete runs a collector too
            made.append(threading.Thread(target=lambda: (store.put_state("new", "k", 1), connections[alias].close())))
            made[0].start()
            made[0].join(30)
        return real_delete(self)

    account_errors: list[Exception] = []

    def delete_account() -> None:
        try:
            Collector.delete = made_after_listing
            users.get(pk=user.pk).delete()
        except Exception as error:  # noqa: BLE001  (the assertion below shows it)
            account_errors.append(error)
        finally:
            Collector.delete = real_delete
            connections[alias].close()

    writer = threading.Thread(target=agent)
    if write != "new thread":
        writer.start()
        assert writing.wait(30)
    deleter = threading.Thread(target=delete_account)
    deleter.start()
    deleter.join(0.5)
    if write != "new thread":
        assert deleter.is_alive()  # waiting for the agent's write
        release.set()
        writer.join(30)
    deleter.join(30)
    assert account_errors == []
    assert not users.filter(pk=user.pk).exists()
    for model in (models.Thread, models.StateEntry, models.Event):
        assert not model.objects.using(alias).exists(), model


@pytest.mark.django_db(databases=["postgres"], transaction=True)
@pytest.mark.parametrize("kind", ["memory", "store item"])
def test_an_account_deleted_while_its_agent_writes_memories_is_deleted(kind, django_user_model, monkeypatch):
    """The collector deletes an account's memories and items by owner early in its transaction,
    and the account's row last: one written in between committed, and the account's delete
    failed at commit on its foreign key (helper-99: 180 of 200 races). The account's row is now
    locked first: the write waits for the delete, then fails on its foreign key."""
    from django.db import IntegrityError
    from django.db.models import QuerySet

    from afkmemory import models
    from afkmemory.memory import LongTermMemory
    from afkmemory.stores import SyncDjangoStore

    alias = "postgres"
    user = django_user_model.objects.db_manager(alias).create_user("leaving")
    model = models.LongTermMemory if kind == "memory" else models.StoreItem

    def write(key: str) -> None:
        if kind == "memory":
            SyncDjangoMemoryStore(owner=user, using=alias).upsert_long_term_memory(LongTermMemory(key, "u"))
        else:
            SyncDjangoStore(owner=user, using=alias).put(("ns",), key, 1)

    write("early")
    writer_errors: list[Exception] = []

    def agent() -> None:
        try:
            write("late")  # another key: one the delete took would wait for it on the unique index
        except Exception as error:  # noqa: BLE001  (the assertion below shows it)
            writer_errors.append(error)
        finally:
            connections[alias].close()

    real_raw_delete = QuerySet._raw_delete
    writers: list[threading.Thread] = []

    def then_a_write(self, using):  # the agent writes right after the collector deleted the account's rows
        deleted = real_raw_delete(self, using)
        if self.model is model and not writers:
            writers.append(threading.Thread(target=agent))
            writers[0].start()
            writers[0].join(1)  # committed by now, unless it waits for the account's row
        return deleted

    monkeypatch.setattr(QuerySet, "_raw_delete", then_a_write)
    django_user_model.objects.db_manager(alias).get(pk=user.pk).delete()  # no IntegrityError at commit
    writers[0].join(30)
    assert not django_user_model.objects.db_manager(alias).filter(pk=user.pk).exists()
    assert not model.objects.using(alias).exists()
    assert [type(error) for error in writer_errors] == [IntegrityError]  # the write came too late


@pytest.mark.django_db(databases=["postgres"], transaction=True)
def test_an_agent_writing_a_thread_then_a_memory_while_its_account_is_deleted_does_not_deadlock(django_user_model):
    """The account's row is locked after its threads are deleted, not before: taken first, it
    deadlocked with a transaction that had written to a thread (which the delete waits for)
    and then wrote a memory (which waited for the account's row)."""
    from django.db import transaction

    from afkmemory import models
    from afkmemory.memory import LongTermMemory

    alias = "postgres"
    users = django_user_model.objects.db_manager(alias)
    user = users.create_user("leaving")
    store = SyncDjangoMemoryStore(owner=user, using=alias)
    store.append_event(MemoryEvent("e0", "t", None, "message", 0, {}, []))
    wrote_thread, go = threading.Event(), threading.Event()
    errors: list[Exception] = []

    def agent() -> None:
        try:
            with transaction.atomic(using=alias):
                store.put_state("t", "k", 1)  # holds the thread (FOR KEY SHARE) until it commits
                wrote_thread.set()
                go.wait(30)
                store.upsert_long_term_memory(LongTermMemory("m", "u"))
        except Exception as error:  # noqa: BLE001  (the assertion below shows it)
            errors.append(error)
        finally:
            connections[alias].close()

    def delete_account() -> None:
        try:
            users.get(pk=user.pk).delete()
        except Exception as error:  # noqa: BLE001
            errors.append(error)
        finally:
            connections[alias].close()

    writer, deleter = threading.Thread(target=agent), threading.Thread(target=delete_account)
    writer.start()
    assert wrote_thread.wait(30)
    deleter.start()
    deleter.join(0.5)
    assert deleter.is_alive(), errors  # waiting for the agent's write to the thread
    go.set()
    writer.join(30)
    deleter.join(30)
    assert errors == []
    assert not users.filter(pk=user.pk).exists()
    for model in (models.Thread, models.Event, models.StateEntry, models.LongTermMemory):
        assert not model.objects.using(alias).exists(), model


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@pytest.mark.parametrize("alias", ["default", "postgres"])
def test_an_append_whose_thread_is_deleted_and_remade_with_its_id_is_a_duplicate(alias, monkeypatch):
    """An append whose thread was deleted while its statement ran goes again, making the thread;
    another writer had made it anew with the same id first, and that retry's unique violation
    escaped as a bare IntegrityError: a 500 from POST events/ where a duplicate is a 409
    (helper-99: 197 of 200 races on PostgreSQL, 27 on SQLite)."""
    from django.db import IntegrityError

    from afkmemory import models
    from afkmemory.memory import DuplicateEventError

    store = SyncDjangoMemoryStore(using=alias)
    store.append_event(MemoryEvent("e0", "t", None, "message", 0, {}, []))
    twin = MemoryEvent("e1", "t", None, "message", 1, {}, [])
    real_make = store._append_making_thread

    def thread_deleted_meanwhile(event: MemoryEvent) -> bool:
        models.Thread.objects.using(alias).filter(thread_id="t").delete()
        raise IntegrityError("the thread's foreign key: deleted while the insert ran")

    def twin_first(event: MemoryEvent) -> None:
        real_make(twin)  # the other writer, remaking the thread with the same id
        real_make(event)

    monkeypatch.setattr(store, "_insert_into_existing_thread", thread_deleted_meanwhile)
    monkeypatch.setattr(store, "_append_making_thread", twin_first)
    with pytest.raises(DuplicateEventError):
        store.append_event(twin)
    assert list(models.Event.objects.using(alias).values_list("event_id", flat=True)) == ["e1"]


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("alias", ["default", "postgres"])
@pytest.mark.parametrize("how", ["instance", "queryset"])
def test_an_accounts_delete_is_heard_once_per_thread_and_record(alias, how, django_user_model):
    """The pre_delete receiver takes an account's threads inside its delete; Django's collector
    then deleted them again from the list it made before (no rows left), and the project's
    receivers heard each thread, and each record under it, twice."""
    from collections import Counter

    from django.db.models.signals import post_delete, pre_delete

    from afkmemory import models

    user = django_user_model.objects.db_manager(alias).create_user("leaving")
    store = SyncDjangoMemoryStore(owner=user, using=alias)
    store.append_events([MemoryEvent(f"e{i}", f"t{i % 2}", None, "message", i, {}, []) for i in range(3)])
    heard: Counter[tuple[str, str, str]] = Counter()

    def hear(sender: type, instance: object, signal: object, **kwargs: object) -> None:
        name = getattr(instance, "thread_id", None) if sender is models.Thread else instance.event_id
        heard[("pre" if signal is pre_delete else "post", sender.__name__, str(name))] += 1

    receivers = [(signal, model) for signal in (pre_delete, post_delete) for model in (models.Thread, models.Event)]
    for signal, model in receivers:
        signal.connect(hear, sender=model)
    try:
        accounts = django_user_model.objects.db_manager(alias).filter(pk=user.pk)
        (accounts.get() if how == "instance" else accounts).delete()
    finally:
        for signal, model in receivers:
            signal.disconnect(hear, sender=model)
    expected = [("Thread", "t0"), ("Thread", "t1"), ("Event", "e0"), ("Event", "e1"), ("Event", "e2")]
    assert heard == Counter({(when, *row): 1 for when in ("pre", "post") for row in expected})
    assert not models.Thread.objects.using(alias).exists() and not models.Event.objects.using(alias).exists()


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_a_sqlite_compaction_lets_other_writers_in_between_its_batches(settings):
    """SQLite has one write lock: a compaction holding it for the whole thread made every other
    writer wait for all of it, and fail with "database is locked" past its ``timeout``. Here a
    writer gets in while the thread is partly compacted, which one transaction never shows."""
    store = SyncDjangoMemoryStore()
    store.append_event(MemoryEvent("seed", "huge", "u", "message", 1, {}))
    store.append_event(MemoryEvent("first", "other", "u", "message", 1, {}))
    events = 200_000
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT id FROM afkmemory_thread WHERE thread_id = 'huge'")
        [huge] = cursor.fetchone()
        cursor.execute("SELECT id FROM afkmemory_thread WHERE thread_id = 'other'")
        [other] = cursor.fetchone()
        cursor.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < %s) "
            "INSERT INTO afkmemory_event (event_id, user_id, type, timestamp, payload, tags, thread_id) "
            "SELECT 'e' || i, 'u', 'message', 1000 + i, '{}', '[]', %s FROM n",
            [events, huge],
        )
    settings.AFKMEMORY = {**settings.AFKMEMORY, "DELETE_BATCH_SIZE": 500}
    results = []

    def compact() -> None:
        try:
            results.append(SyncDjangoMemoryStore().compact_thread("huge", RetentionPolicy(max_events_per_thread=10)))
        finally:
            connections.close_all()

    compactor = threading.Thread(target=compact)
    writer = sqlite3.connect(connections["default"].settings_dict["NAME"], isolation_level=None, timeout=30)
    seen = []  # the compacted thread's size as each write of another thread saw it
    try:
        compactor.start()
        while compactor.is_alive():
            writer.execute("BEGIN IMMEDIATE")
            seen += writer.execute("SELECT count(*) FROM afkmemory_event WHERE thread_id = ?", (huge,)).fetchone()
            writer.execute("INSERT INTO afkmemory_event (event_id, user_id, type, timestamp, payload, tags, thread_id) "
                           "VALUES (?, 'u', 'message', 5, '{}', '[]', ?)", (f"w{len(seen)}", other))  # fmt: skip
            writer.execute("COMMIT")
            time.sleep(0.01)  # an agent's pace, not a loop that would hold the lock itself
    finally:
        compactor.join()
        writer.close()
    [result] = results
    assert (result.events_before, result.events_after, result.events_removed) == (events + 1, 10, events + 1 - 10)
    assert any(10 < size < events + 1 for size in seen), f"no write got in between the batches: {sorted(set(seen))}"
    assert len(store.get_recent_events("other", 1_000_000)) == 1 + len(seen)


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_a_sqlite_compaction_inside_a_callers_transaction_is_one_transaction(settings, monkeypatch):
    """There the batches cannot commit on their own: pausing after each held the lock twice as long."""
    from django.db import transaction

    store = SyncDjangoMemoryStore()
    store.append_events([MemoryEvent(f"e{i}", "t", "u", "message", 1000 + i, {}) for i in range(40)])
    settings.AFKMEMORY = {**settings.AFKMEMORY, "DELETE_BATCH_SIZE": 5}
    pauses = []
    monkeypatch.setattr(memory_stores.time, "sleep", pauses.append)
    with transaction.atomic(using="default"):
        assert store.compact_thread("t", RetentionPolicy(max_events_per_thread=2)).events_removed == 38
    assert pauses == []
    assert store.compact_thread("t", RetentionPolicy(max_events_per_thread=1)).events_removed == 1
    assert len(pauses) == 1  # outside one, each batch commits and pauses
