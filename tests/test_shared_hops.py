"""Concurrent async calls bound for one thread share a hop; ``get``, ``put`` and ``append_event`` a statement.

Each test checks what a caller can see: the statements Django's connection ran (recorded
with ``execute_wrapper`` on the hop's thread), which thread ran them, each caller's own
answer or error, and what the database holds afterwards.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import threading
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import OperationalError, connections, transaction

from afkmemory.memory import MemoryEvent
from afkmemory.models import StoreItem
from afkmemory.stores import (
    DjangoMemoryStore,
    DjangoStore,
    SyncDjangoMemoryStore,
    SyncDjangoStore,
    concurrency,
    own_thread,
)
from tests.utils import FLUSHED_APPS, in_processes

pytestmark = pytest.mark.django_db(
    databases=["default", "postgres", "postgres_bound"], transaction=True, available_apps=FLUSHED_APPS
)

ALIASES = ["default", "postgres", "postgres_bound"]  # the last: server-side binding, prepared
NS = ("users", "u1", "memories")


class Statements:
    """The statements run on ``alias``'s connection of the threads it is installed on, with their thread."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.seen: list[tuple[str, str]] = []

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        self.seen.append((threading.current_thread().name, sql))
        return execute(sql, params, many, context)

    def install(self) -> None:
        connections[self.alias].execute_wrappers.append(self)

    def remove(self) -> None:
        connections[self.alias].execute_wrappers.remove(self)

    def like(self, start: str) -> list[tuple[str, str]]:
        return [(thread, sql) for thread, sql in self.seen if sql.lstrip().upper().startswith(start)]


def recording(alias: str, body: Any) -> tuple[Any, Statements]:
    """Run ``body()`` (a coroutine function) in a fresh loop with the shared thread's statements recorded."""
    statements = Statements(alias)

    async def main() -> Any:
        await sync_to_async(statements.install)()
        try:
            return await body()
        finally:
            await sync_to_async(statements.remove)()
            await sync_to_async(connections.close_all)()

    return asyncio.run(main()), statements


async def together(*calls: Any) -> list[Any]:
    """Await ``calls`` made while the shared thread is busy, so that they all wait for one hop.

    A hop goes as soon as its first call is made, and the calls made before its thread
    takes it join it: how many do depends on how fast that thread wakes. Holding the
    thread makes it all of them, every time. Exceptions are returned, not raised.
    """
    release = threading.Event()
    busy = asyncio.ensure_future(sync_to_async(release.wait)(30))
    await asyncio.sleep(0)  # the busy call is first in the thread's queue
    tasks = [asyncio.ensure_future(call) for call in calls]
    await asyncio.sleep(0)  # every call is made: the first sent the hop, the others joined it
    release.set()
    assert await busy
    return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("alias", ALIASES)
def test_concurrent_puts_and_gets_are_one_statement_each(alias):
    store = DjangoStore(using=alias)
    keys = [f"k{i}" for i in range(8)]

    async def body() -> tuple[list[Any], list[Any]]:
        put = await together(*(store.put(NS, key, {"n": i}) for i, key in enumerate(keys)))
        got = await together(*(store.get(NS, key) for key in [*keys, "missing"]))
        return put, got

    (put, got), statements = recording(alias, body)
    assert [(item.key, item.value) for item in put] == [(key, {"n": i}) for i, key in enumerate(keys)]
    assert [item and (item.key, item.value, item.created_at) for item in got] == [
        *((item.key, item.value, item.created_at) for item in put),
        None,
    ]
    inserts, selects = statements.like("INSERT"), statements.like("SELECT")
    assert len(inserts) == 1 and len(selects) == 1, statements.seen  # eight calls, one statement
    assert len({thread for thread, _ in statements.seen}) == 1  # on the one shared thread
    assert StoreItem.objects.using(alias).count() == 8
    assert not concurrency._turns  # no hop is left open


@pytest.mark.parametrize("alias", ALIASES)
def test_puts_of_one_key_in_one_turn_land_in_call_order(alias):
    store = DjangoStore(using=alias)

    async def body() -> list[Any]:
        return await together(*(store.put(NS, "same", {"n": i}) for i in range(4)))

    put, statements = recording(alias, body)
    assert [item.value for item in put] == [{"n": i} for i in range(4)]
    assert SyncDjangoStore(using=alias).get(NS, "same").value == {"n": 3}  # the last call made wins
    assert len(statements.like("INSERT")) == 4  # an upsert cannot write one row twice: one each


@pytest.mark.parametrize("alias", ALIASES)
def test_other_calls_share_the_hop_and_run_in_call_order(alias, monkeypatch):
    hops = []  # the calls each hop carried
    real = concurrency._run_turn

    def counted(turn: Any, loop: Any) -> Any:
        hops.append(len(turn.calls))
        return real(turn, loop)

    monkeypatch.setattr(concurrency, "_run_turn_there", sync_to_async(counted))
    memory = DjangoMemoryStore(using=alias)

    async def body() -> list[Any]:
        await memory.put_state("t1", "order", [])  # creates the thread
        hops.clear()
        await together(*(memory.put_state("t1", f"k{i}", i) for i in range(8)))
        await together(*(memory.put_state("t1", "order", [i]) for i in range(8)))
        return [hops[:], await memory.list_state("t1")]

    (hops_seen, state), statements = recording(alias, body)
    assert hops_seen == [8, 8]  # eight put_state calls, one hop, twice ...
    assert state == {"order": [7], **{f"k{i}": i for i in range(8)}}  # ... each did its work, the last made last
    assert len({thread for thread, _ in statements.seen}) == 1


@pytest.mark.parametrize("alias", ALIASES)
def test_a_call_between_two_of_one_kind_keeps_its_place(alias):
    """Only consecutive calls of one kind share a statement: a put made after a delete is not written before it."""
    store, memory = DjangoStore(using=alias), DjangoMemoryStore(using=alias)
    event = [MemoryEvent(f"e{i}", "t1", None, "message", i, {}, []) for i in range(3)]

    async def body() -> list[Any]:
        await store.put(NS, "g", 0)
        await memory.append_event(event[0])
        return [
            await together(store.put(NS, "k", 1), store.delete(NS, "k"), store.put(NS, "k", 2)),
            await together(store.delete(NS, "g"), store.get(NS, "g"), store.put(NS, "g", 1), store.get(NS, "g")),
            await together(
                memory.append_event(event[1]),
                memory.replace_thread_events("t1", [event[0]]),
                memory.append_event(event[2]),
            ),
        ]

    (puts, gets, _), statements = recording(alias, body)
    assert [puts[0].value, puts[1], puts[2].value] == [1, True, 2]
    assert SyncDjangoStore(using=alias).get(NS, "k").value == 2
    assert [gets[1], gets[3].value] == [None, 1]
    assert [e.id for e in SyncDjangoMemoryStore(using=alias).get_recent_events("t1")] == ["e0", "e2"]
    assert len({thread for thread, _ in statements.seen}) == 1  # all on the shared thread, in hops it shared


@pytest.mark.parametrize("alias", ALIASES)
def test_concurrent_appends_are_one_statement(alias):
    memory = DjangoMemoryStore(using=alias)

    def event(n: int, thread: str = "t1") -> MemoryEvent:
        return MemoryEvent(f"e{n}", thread, None, "message", n, {"n": n}, [])

    SyncDjangoMemoryStore(using=alias).append_event(event(0))  # creates the thread

    async def body() -> tuple[list[Any], list[Any]]:
        await together(*(memory.append_event(event(n)) for n in range(1, 9)))
        return await memory.get_recent_events("t1", 20), await memory.get_recent_events("t2", 20)

    (events, other), statements = recording(alias, body)
    assert sorted(e.id for e in events) == [f"e{n}" for n in range(9)] and other == []
    assert [e.payload for e in sorted(events, key=lambda e: e.timestamp)] == [{"n": n} for n in range(9)]
    inserts = statements.like("INSERT")
    assert len(inserts) == 1 and inserts[0][1].count("UNION ALL") == 7  # the eight together


@pytest.mark.parametrize("alias", ALIASES)
def test_a_taken_event_id_fails_alone_and_new_threads_are_made(alias):
    memory = DjangoMemoryStore(using=alias)

    def event(n: int, thread: str = "t1", event_id: str | None = None) -> MemoryEvent:
        return MemoryEvent(event_id or f"e{n}", thread, None, "message", n, {}, [])

    async def body() -> tuple[list[Any], list[str], list[str]]:
        await memory.append_event(event(0))
        results = await together(
            memory.append_event(event(1)),
            memory.append_event(event(2, event_id="e0")),  # taken in t1
            memory.append_event(event(3, thread="new")),  # its thread does not exist yet
            memory.append_event(event(4)),
        )
        t1 = [e.id for e in await memory.get_recent_events("t1", 20)]
        new = [e.id for e in await memory.get_recent_events("new", 20)]
        return results, t1, new

    (results, t1, new), _ = recording(alias, body)
    assert [results[0], *results[2:]] == [None, None, None]
    assert isinstance(results[1], ValueError) and "'e0' already exists" in str(results[1])
    assert sorted(t1) == ["e0", "e1", "e4"] and new == ["e3"]


def test_each_call_runs_in_its_callers_context_and_gets_its_own_error():
    who: contextvars.ContextVar[str] = contextvars.ContextVar("who")

    def work(n: int) -> str:
        if n == 2:
            raise ValueError(f"call {n} fails")
        return f"{who.get()}:{n}:{threading.current_thread().name}"

    async def caller(n: int) -> str:
        who.set(f"caller{n}")
        return await concurrency.hop(work)(n)

    async def main() -> list[Any]:
        return await asyncio.gather(*(caller(n) for n in range(4)), return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[2], ValueError) and str(results[2]) == "call 2 fails"
    answers = [results[n].split(":") for n in (0, 1, 3)]
    assert [(name, n) for name, n, _ in answers] == [("caller0", "0"), ("caller1", "1"), ("caller3", "3")]
    assert len({thread for *_, thread in answers}) == 1 and answers[0][2] != threading.current_thread().name


def test_joined_calls_see_and_hand_back_their_callers_context_as_sync_to_async_does():
    """Django's active language and time zone (asgiref Locals) reach each call; what a call sets reaches its caller."""
    from django.utils import timezone, translation

    mark: contextvars.ContextVar[str] = contextvars.ContextVar("mark", default="")
    zones = ["Asia/Tokyo", "Europe/Paris", "America/Lima"]

    def seen(n: int) -> tuple[str, str]:
        mark.set(f"set by call {n}")
        return translation.get_language(), str(timezone.get_current_timezone())

    async def caller(n: int, call: Any) -> tuple[Any, str]:
        translation.activate(["de", "fr", "es"][n])
        timezone.activate(zones[n])
        return await call(n), mark.get()

    async def main(call: Any) -> list[Any]:
        release = threading.Event()
        busy = asyncio.ensure_future(sync_to_async(release.wait)(30))  # the three calls share one hop
        await asyncio.sleep(0)
        results = asyncio.gather(*(caller(n, call) for n in range(3)))
        await asyncio.sleep(0)
        release.set()
        await busy
        return await results

    expected = [
        ((language, zone), f"set by call {n}")
        for n, (language, zone) in enumerate(zip(["de", "fr", "es"], zones, strict=True))
    ]
    assert asyncio.run(main(sync_to_async(seen))) == expected  # what sync_to_async does
    assert asyncio.run(main(concurrency.hop(seen))) == expected


def test_a_call_raising_past_exception_leaves_no_caller_waiting():
    class Abort(BaseException):  # not an Exception: the hop itself ends with it
        pass

    def work(n: int) -> int:
        if n == 1:
            raise Abort
        return n

    async def main() -> list[Any]:
        return await together(*(concurrency.hop(work)(n) for n in range(3)))

    results = asyncio.run(asyncio.wait_for(main(), 30))
    assert [type(result) for result in results] == [Abort] * 3  # the hop's callers, each told
    assert not concurrency._turns


@pytest.mark.parametrize("alias", ALIASES)
def test_callers_in_their_own_threads_do_not_share_a_hop(alias):
    store = DjangoStore(using=alias)
    SyncDjangoStore(using=alias).put(NS, "k", 1)

    def where() -> tuple[str, bool]:
        return threading.current_thread().name, connections[alias].connection is not None

    release = threading.Event()

    async def caller() -> tuple[Any, str, bool]:
        async with own_thread():
            busy = asyncio.ensure_future(sync_to_async(release.wait)(30))  # holds this caller's thread
            await asyncio.sleep(0)
            item = await store.get(NS, "k")  # waits while the others make theirs
            assert await busy
            return item, *(await sync_to_async(where)())

    async def main() -> list[Any]:
        callers = [asyncio.ensure_future(caller()) for _ in range(4)]
        await asyncio.sleep(0.05)  # all four calls are made and waiting
        release.set()
        return await asyncio.gather(*callers)

    seen = asyncio.run(main())
    assert [item.value for item, _, _ in seen] == [1] * 4
    assert len({thread for _, thread, _ in seen}) == 4
    assert all(connected for *_, connected in seen)  # each call ran on its caller's thread, which it connected


@pytest.mark.parametrize("alias", ALIASES)
def test_under_async_to_sync_the_calls_run_in_the_callers_transaction(alias):
    store, memory = DjangoStore(using=alias), DjangoMemoryStore(using=alias)
    statements = Statements(alias)
    caller_thread = threading.current_thread().name

    async def calls() -> list[Any]:
        return await together(
            *(store.put(NS, f"k{i}", i) for i in range(4)),
            *(memory.append_event(MemoryEvent(f"e{i}", "t1", None, "message", i, {}, [])) for i in range(4)),
        )

    class Undo(Exception):
        pass

    with pytest.raises(Undo), transaction.atomic(using=alias):
        SyncDjangoMemoryStore(using=alias).put_state("t1", "k", 1)  # the thread
        statements.install()
        try:
            items = async_to_sync(calls)()
        finally:
            statements.remove()
        assert [item.value for item in items[:4]] == [0, 1, 2, 3] and items[4:] == [None] * 4
        assert StoreItem.objects.using(alias).count() == 4  # written in this transaction ...
        assert len(SyncDjangoMemoryStore(using=alias).get_recent_events("t1")) == 4
        raise Undo
    assert StoreItem.objects.using(alias).count() == 0  # ... and rolled back with it
    assert SyncDjangoMemoryStore(using=alias).get_recent_events("t1") == []
    inserts = statements.like("INSERT")
    assert len(inserts) == 8  # one statement per call inside a transaction, as unshared
    assert {thread for thread, _ in inserts} == {caller_thread}


@pytest.mark.parametrize("alias", ALIASES)
def test_a_put_the_driver_refuses_fails_alone(alias, monkeypatch):
    """One row the driver cannot send fails the shared statement: each put is sent again alone."""

    class Unsendable:  # no driver adapts it: the statement fails before it runs
        pass

    real = SyncDjangoStore._prepare_put

    def prepare_put(self: Any, namespace: Any, key: str, value: Any, ttl: Any) -> Any:
        put, result = real(self, namespace, key, value, ttl)
        if key == "k3":
            put.row[3] = Unsendable()  # in place of the value's JSON text
        return put, result

    monkeypatch.setattr(SyncDjangoStore, "_prepare_put", prepare_put)
    store = DjangoStore(using=alias)

    async def body() -> list[Any]:
        return await together(*(store.put(NS, f"k{i}", {"n": i}) for i in range(8)))

    results, statements = recording(alias, body)
    assert isinstance(results[3], Exception) and "Unsendable" in str(results[3])
    assert [item.value for i, item in enumerate(results) if i != 3] == [{"n": i} for i in range(8) if i != 3]
    stored = {item.key: item.value for item in SyncDjangoStore(using=alias).search(NS)}
    assert stored == {f"k{i}": {"n": i} for i in range(8) if i != 3}
    assert len(statements.like("INSERT")) == 1 + 8  # the shared statement failed whole; then one each


@pytest.mark.parametrize("call", ["put", "append_event"])
def test_a_shared_statement_that_finds_sqlite_locked_is_not_sent_again_call_by_call(call):
    """Another process holds SQLite's write lock past the timeout: the shared statement fails, and
    each call alone would wait out the timeout again, one after another (64 calls, 30 s each, in
    the example project's settings). Every caller gets the one "database is locked" instead."""
    import sqlite3

    alias = "default"
    store, memory = DjangoStore(using=alias), DjangoMemoryStore(using=alias)
    SyncDjangoMemoryStore(using=alias).append_event(MemoryEvent("e0", "t1", None, "message", 0, {}, []))

    def make(n: int) -> Any:
        if call == "put":
            return store.put(NS, f"k{n}", {"n": n})
        return memory.append_event(MemoryEvent(f"e{n}", "t1", None, "message", n, {}, []))

    def wait_briefly() -> None:  # for the lock, on the shared thread's connection
        with connections[alias].cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout = 50")

    async def body() -> list[Any]:
        await sync_to_async(wait_briefly)()
        return await together(*(make(n) for n in range(1, 9)))

    holder = sqlite3.connect(connections[alias].settings_dict["NAME"], isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # the write lock, as another process's transaction holds it
        results, statements = recording(alias, body)
    finally:
        holder.close()
    assert all(isinstance(result, OperationalError) and "locked" in str(result) for result in results), results
    assert len(statements.like("INSERT")) == 1  # the shared one, not again call by call
    assert not StoreItem.objects.using(alias).exists()
    assert [e.id for e in SyncDjangoMemoryStore(using=alias).get_recent_events("t1", 20)] == ["e0"]


@pytest.mark.parametrize("alias", ALIASES)
def test_cancelled_callers_calls_do_not_run_and_the_others_still_do(alias):
    store = DjangoStore(using=alias)
    release = threading.Event()

    async def main() -> list[Any]:
        busy = asyncio.ensure_future(sync_to_async(release.wait)(30))  # holds the shared thread
        await asyncio.sleep(0.05)
        first = asyncio.ensure_future(store.put(NS, "first", 1))  # sends the hop, which waits
        await asyncio.sleep(0)
        joined = [asyncio.ensure_future(store.put(NS, f"joined{i}", i)) for i in range(3)]
        await asyncio.sleep(0.05)
        first.cancel()  # before its hop ran: the joined calls go in a hop of their own
        joined[0].cancel()  # a joined call given up before it ran: skipped
        await asyncio.sleep(0.05)  # the cancellations take effect while the thread is still busy
        release.set()
        results = await asyncio.gather(first, *joined, busy, return_exceptions=True)
        await sync_to_async(connections.close_all)()
        return results

    results = asyncio.run(main())
    assert isinstance(results[0], asyncio.CancelledError) and isinstance(results[1], asyncio.CancelledError)
    assert [item.value for item in results[2:4]] == [1, 2]
    assert sorted(StoreItem.objects.using(alias).values_list("key", flat=True)) == ["joined1", "joined2"]
    assert not concurrency._turns


def test_calls_of_a_cancelled_callers_hop_still_run_before_calls_made_after_them():
    """The joined calls of a hop whose sender is cancelled go in a hop of their own, and a call
    made after them (here, as the cancellation lands) joins that hop behind them."""
    ran: list[str] = []
    record = concurrency.hop(ran.append)

    async def main() -> list[Any]:
        release = threading.Event()
        busy = asyncio.ensure_future(sync_to_async(release.wait)(30))  # holds the shared thread
        await asyncio.sleep(0.05)
        first = asyncio.ensure_future(record("first"))  # sends the hop, which waits for the thread
        await asyncio.sleep(0)
        joined = [asyncio.ensure_future(record(f"joined{i}")) for i in range(2)]
        await asyncio.sleep(0.05)
        first.cancel()  # before its hop ran
        later = asyncio.ensure_future(record("later"))  # runs in the same turn of the loop as the cancellation
        await asyncio.sleep(0.05)
        release.set()
        return await asyncio.gather(first, *joined, later, busy, return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[0], asyncio.CancelledError) and results[1:4] == [None, None, None]
    assert ran == ["joined0", "joined1", "later"]
    assert not concurrency._turns


DEADLOCKS = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"


def race_puts(alias: str, seed: int, rounds: int) -> int:
    """Put the same eight keys from eight coroutines, in a shuffled order, ``rounds`` times; count the puts."""
    store = DjangoStore(using=alias)
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(8)]

    async def main() -> int:
        done = 0
        for n in range(rounds):
            rng.shuffle(keys)
            done += len(await asyncio.gather(*(store.put(NS, key, {"by": seed, "round": n}) for key in keys)))
        await sync_to_async(connections.close_all)()
        return done

    return asyncio.run(main())


@pytest.mark.slow
def test_processes_putting_the_same_keys_in_shared_statements_do_not_deadlock():
    # Each process's statement locks its rows sorted by key, so two never wait on each other in a cycle;
    # a deadlock would surface as an error here (the failed statement is retried call by call, but the
    # retry is the exception, not the rule: a lone put cannot deadlock).
    with connections["postgres"].cursor() as cursor:
        cursor.execute(DEADLOCKS)
        before = cursor.fetchone()[0]
        counts = in_processes(race_puts, [("postgres", seed, 40) for seed in range(4)])
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(DEADLOCKS)
        after = cursor.fetchone()[0]
    assert counts == [40 * 8] * 4
    assert after == before  # the server detected no deadlock
    values = StoreItem.objects.using("postgres").values_list("value", flat=True)
    assert sorted(value["round"] for value in values) == [39] * 8  # every key holds a last round's write


def test_a_loop_closing_on_a_waiting_hop_leaves_no_turn_behind():
    """asyncio.run (or async_to_sync) ends while a hop with joined calls waits for the shared thread:
    its sender's cancellation resent the joined calls (cancelled too) in a task made after the
    shutdown's sweep, which the closing loop never ran: the turn and the task stayed for good."""
    ran: list[int] = []
    record = concurrency.hop(ran.append)
    release = threading.Event()

    async def main() -> None:
        asyncio.ensure_future(sync_to_async(release.wait)(30))  # holds the shared thread
        await asyncio.sleep(0.05)
        for i in range(3):  # the first sends the hop, the other two join it
            asyncio.ensure_future(record(i))
        await asyncio.sleep(0.05)
        # main ends: asyncio.run cancels the three calls (and the busy one) and closes the loop

    try:
        asyncio.run(main())
        release.set()
        asyncio.run(sync_to_async(lambda: None)())  # the shared thread has run what was queued on it
        assert ran == []  # nothing of the cancelled calls ran
        assert not concurrency._turns, concurrency._turns
        assert not concurrency._resending, concurrency._resending
    finally:
        release.set()
        for slot in [slot for slot in concurrency._turns if slot[0].is_closed()]:
            del concurrency._turns[slot]
        concurrency._resending.difference_update([t for t in concurrency._resending if t.get_loop().is_closed()])


def test_own_thread_closes_its_connection_when_cancelled_on_the_way_out():
    """own_thread() closes the connections its thread opened, even when its caller is cancelled while
    it waits to close them (behind a call an inner timeout left running on that thread)."""
    import contextlib

    release = threading.Event()

    async def main() -> Any:
        opened: dict[str, Any] = {}
        exiting = asyncio.Event()

        def connect() -> Any:
            connections["postgres"].ensure_connection()
            return connections["postgres"]

        async def runner() -> None:
            async with own_thread():
                opened["wrapper"] = await sync_to_async(connect)()
                with contextlib.suppress(TimeoutError):  # an inner timeout: the call runs on
                    await asyncio.wait_for(sync_to_async(release.wait)(30), 0.01)
                exiting.set()
            # own_thread's exit now waits for close_all, queued behind the running call

        task = asyncio.create_task(runner())
        await exiting.wait()  # runner has left the block and awaits close_all
        task.cancel()  # e.g. the job's own timeout, or a worker shutting down
        await asyncio.sleep(0)  # the cancellation lands while the call still runs
        release.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return opened["wrapper"]

    wrapper = asyncio.run(main())
    try:
        assert wrapper.connection is None, "own_thread() exited, its thread's connection is still open"
    finally:
        if wrapper.connection is not None:
            wrapper.connection.close()
