"""The async stores on their own connections (``ASYNC_POOL``): both conformance suites again, and the pool's rules."""

from __future__ import annotations

import asyncio
import gc
import random
import socket
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections import Counter
from typing import Any

import pytest
from agentflow.errors import StoreConflict
from django.db import DatabaseError, OperationalError, ProgrammingError, connections
from django.test.utils import CaptureQueriesContext

from afkmemory.memory import MemoryEvent
from afkmemory.namespaces import encode
from afkmemory.stores import DjangoMemoryStore, DjangoStore, asyncpool
from tests import test_memory_conformance, test_store_conformance
from tests.conftest import DIMENSIONS
from tests.utils import FLUSHED_APPS, in_processes, run

# The pool's connections commit each statement: the tests must not hide rows in a transaction.
pytestmark = pytest.mark.django_db(databases=["default", "postgres"], transaction=True, available_apps=FLUSHED_APPS)

POOLED = {"EMBEDDING_DIMENSIONS": DIMENSIONS, "EXACT_SEARCH_THRESHOLD": 200, "ASYNC_POOL": True, "ASYNC_POOL_SIZE": 4}


@pytest.fixture(autouse=True)
def pool_on(settings: Any) -> None:
    settings.AFKMEMORY = POOLED


# Every test of both conformance suites, collected here again with these fixtures: the
# stores follow the setting, so the suites' own DjangoStore(...) calls are pooled too.
@pytest.fixture
def store() -> DjangoStore:
    return DjangoStore(using="postgres")


django_store = store


@pytest.fixture
def memory_store() -> DjangoMemoryStore:
    return DjangoMemoryStore(using="postgres")


for _suite in (test_store_conformance, test_memory_conformance):
    globals().update({name: test for name, test in vars(_suite).items() if name.startswith("test_")})


def ev(i: int, thread: str = "t1") -> MemoryEvent:
    return MemoryEvent(f"e{i}", thread, "u1", "message", i, {"n": i}, ["x"])


# -- the pool is what runs the hot calls ----------------------------------------------------------


def _hot_calls(items: DjangoStore, memory: DjangoMemoryStore, event: int) -> list[Any]:
    """Each hot call once, on data the first calls write; return the answers."""

    async def calls() -> list[Any]:
        return [
            await items.put(("users", "u1"), "color", {"v": "blue"}),
            await items.get(("users", "u1"), "color"),
            await items.search(("users",), limit=10),
            await items.list_namespaces(prefix=("users",)),
            await memory.append_event(ev(event)),
            await memory.get_recent_events("t1"),
            await memory.get_state("t1", "mood"),
            await memory.get_state("t1", "missing"),
        ]

    return run(calls())


def test_hot_calls_send_nothing_through_djangos_connection():
    # The thread's first event and the state write take Django's way (a transaction).
    run(DjangoMemoryStore(using="postgres").append_event(ev(1)))
    run(DjangoMemoryStore(using="postgres").put_state("t1", "mood", "calm"))
    with CaptureQueriesContext(connections["postgres"]) as hopped:
        off = {"using": "postgres", "async_pool": False}
        hop_answers = _hot_calls(DjangoStore(**off), DjangoMemoryStore(**off), 2)
    assert len(hopped) == 8  # one statement each, on Django's connection
    with CaptureQueriesContext(connections["postgres"]) as pooled:
        pool_answers = _hot_calls(DjangoStore(using="postgres"), DjangoMemoryStore(using="postgres"), 3)
    assert len(pooled) == 0
    # The same answers either way (the put's timestamps differ: it wrote twice).
    assert pool_answers[1].value == hop_answers[1].value == {"v": "blue"}
    assert pool_answers[1].created_at == hop_answers[1].created_at  # the second put kept created_at
    assert pool_answers[2:4] == [[pool_answers[1]], [("users", "u1")]]
    assert [e.id for e in pool_answers[5]] == ["e1", "e2", "e3"]
    assert [e.id for e in hop_answers[5]] == ["e1", "e2"]
    assert pool_answers[6:] == hop_answers[6:] == ["calm", None]


def test_a_store_can_choose_for_itself(settings):
    settings.AFKMEMORY = {**POOLED, "ASYNC_POOL": False}
    with CaptureQueriesContext(connections["postgres"]) as pooled:
        run(DjangoStore(using="postgres", async_pool=True).put(("a",), "k", 1))
    with CaptureQueriesContext(connections["postgres"]) as hopped:
        run(DjangoStore(using="postgres").put(("a",), "k", 2))
    assert (len(pooled), len(hopped)) == (0, 1)


def test_the_pool_is_for_postgresql_only():
    with pytest.raises(ValueError, match="needs PostgreSQL"):
        DjangoStore(using="default", async_pool=True)
    with pytest.raises(TypeError, match="async_pool"):
        DjangoMemoryStore(using="postgres", async_pool="yes")  # type: ignore[arg-type]
    # The setting leaves SQLite stores on Django's connection.
    with CaptureQueriesContext(connections["default"]) as hopped:
        run(DjangoStore(using="default").put(("a",), "k", 1))
    assert len(hopped) == 1


# -- the pool's own rules -------------------------------------------------------------------------


def test_connections_are_reused_capped_and_closed_with_their_loop():
    async def scenario() -> tuple[list[int], int, list[Any]]:
        async def backend() -> int:
            async with asyncpool.connection("postgres") as conn:
                cursor = await conn.execute("SELECT pg_backend_pid(), pg_sleep(0.05)")
                return (await cursor.fetchone())[0]

        one_by_one = [await backend() for _ in range(3)]
        at_once = await asyncio.gather(*(backend() for _ in range(12)))
        pool = asyncpool._pools(asyncio.get_running_loop())["postgres"]
        return one_by_one, len(set(at_once)), list(pool.idle)

    one_by_one, distinct, idle = run(scenario())
    assert len(set(one_by_one)) == 1  # one caller at a time: one connection, reused
    assert distinct == POOLED["ASYNC_POOL_SIZE"]  # twelve callers share the four the size allows
    assert len(idle) == POOLED["ASYNC_POOL_SIZE"]
    assert all(conn.closed for conn in idle)  # async_to_sync's loop closed: so did they


def test_pooled_connections_read_timestamps_with_psycopgs_compiled_loader():
    """As the store's statements on Django's connection do (``prepared.native_timestamps``)."""
    from django.db.backends.postgresql.psycopg_any import BaseTzLoader
    from psycopg.postgres import types
    from psycopg.pq import Format

    async def scenario() -> tuple[type, Any]:
        store = DjangoStore(using="postgres")
        await store.put(("a",), "k", 1, ttl=60)
        async with asyncpool.connection("postgres") as conn:
            loader = conn.adapters.get_loader(types["timestamptz"].oid, Format.TEXT)
        return loader, await store.get(("a",), "k")

    loader, pooled = run(scenario())
    assert not issubclass(loader, BaseTzLoader)
    assert pooled == run(DjangoStore(using="postgres", async_pool=False).get(("a",), "k"))
    assert pooled.expires_at.endswith("+00:00") and pooled.created_at.endswith("+00:00")


def test_close_async_pools_closes_the_loops_connections():
    async def scenario() -> list[Any]:
        await DjangoStore(using="postgres").get(("a",), "k")
        idle = list(asyncpool._pools(asyncio.get_running_loop())["postgres"].idle)
        await asyncpool.close_async_pools()
        assert asyncpool._pools(asyncio.get_running_loop()) == {}  # emptied; they still close with the loop
        return idle

    idle = run(scenario())
    assert len(idle) == 1 and idle[0].closed


def test_a_cancelled_call_leaves_a_clean_connection():
    async def scenario() -> tuple[str, int]:
        async def pid_then_sleep(started: asyncio.Event) -> None:
            async with asyncpool.connection("postgres") as conn:
                await conn.execute("SET application_name = 'cancelled'")  # would leak to the next caller
                started.set()
                await conn.execute("BEGIN")
                await conn.execute("SELECT pg_sleep(30)")

        started = asyncio.Event()
        task = asyncio.create_task(pid_then_sleep(started))
        await started.wait()
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # psycopg cancelled the statement on the server; the connection was left in a
        # transaction, so it was closed rather than kept for the next caller.
        pool = asyncpool._pools(asyncio.get_running_loop())["postgres"]
        kept = len(pool.idle)
        async with asyncpool.connection("postgres") as conn:
            cursor = await conn.execute("SELECT current_setting('application_name')")
            (name,) = await cursor.fetchone()
        return name, kept

    name, kept = run(scenario())
    assert kept == 0
    assert name != "cancelled"


def test_database_errors_are_djangos():
    async def bad() -> None:
        await asyncpool.execute("postgres", "SELECT * FROM no_such_table", [])

    with pytest.raises(ProgrammingError, match="no_such_table"):
        run(bad())


def test_concurrent_claims_on_the_pool_have_one_winner():
    store = DjangoStore(using="postgres")

    async def race(key: str) -> Counter[str]:
        async def claim(worker: int) -> str:
            try:
                await store.put(("claims",), key, {"worker": worker}, if_absent=True)
                return "won"
            except StoreConflict:
                return "lost"

        return Counter(await asyncio.gather(*(claim(w) for w in range(8))))

    for i in range(5):
        assert run(race(f"k{i}")) == {"won": 1, "lost": 7}


def _claim_in_a_process(key: str) -> str:
    """A fresh process, asyncio.run and the pool, as a worker running an agent would."""
    from django.test import override_settings

    with override_settings(AFKMEMORY=POOLED):
        store = DjangoStore(using="postgres")
        try:
            asyncio.run(store.put(("claims",), key, "mine", if_absent=True))
            return "won"
        except StoreConflict:
            return "lost"


@pytest.mark.slow
def test_processes_claiming_through_the_pool_have_one_winner():
    results = in_processes(_claim_in_a_process, [("shared",)] * 4)
    assert Counter(results) == {"won": 1, "lost": 3}


def test_a_taken_event_id_and_a_new_thread_take_djangos_way():
    store = DjangoMemoryStore(using="postgres")
    run(store.append_event(ev(1, "fresh")))  # no thread yet: created on Django's side
    run(store.append_event(ev(2, "fresh")))
    with pytest.raises(ValueError, match="already exists"):
        run(store.append_event(ev(2, "fresh")))
    assert [e.id for e in run(store.get_recent_events("fresh"))] == ["e1", "e2"]


# -- batches: the gets and puts of one turn of the loop in one statement -------------------------


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[Any]]]:
    """The SQL and parameters of every statement the pool sends (the pool itself runs unchanged)."""
    sent: list[tuple[str, list[Any]]] = []
    send = asyncpool._Pool.send

    async def counted(pool: Any, conn: Any, sql: str, params: list[Any]) -> Any:
        sent.append((sql, params))
        return await send(pool, conn, sql, params)

    monkeypatch.setattr(asyncpool._Pool, "send", counted)
    return sent


def _xmins(namespace: tuple[str, ...]) -> set[str]:
    """The transactions that last wrote the items of ``namespace``."""
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SELECT xmin::text FROM afkmemory_storeitem WHERE namespace = %s", [encode(namespace)])
        return {xmin for (xmin,) in cursor.fetchall()}


def test_concurrent_puts_are_one_upsert_and_one_commit(statements, django_user_model):
    store = DjangoStore(using="postgres")
    first = run(store.put(("batch",), "k0", "old", ttl=3600))
    statements.clear()

    async def puts() -> list[Any]:
        return await asyncio.gather(*(store.put(("batch",), f"k{i}", {"n": i}) for i in range(8)))

    items = run(puts())
    assert len(statements) == 1
    assert len(_xmins(("batch",))) == 1  # one transaction wrote all eight
    [(eight, _)] = statements
    assert [(item.key, item.value) for item in items] == [(f"k{i}", {"n": i}) for i in range(8)]
    assert items[0].created_at == first.created_at and items[0].expires_at is None  # a live row kept its birth
    assert items == [run(store.get(("batch",), f"k{i}")) for i in range(8)]
    # Any number of rows is the same statement (arrays, one per column): parsed and prepared once.
    owned = DjangoStore(owner=django_user_model.objects.db_manager("postgres").create(username="b"), using="postgres")

    tricky = [0, None, 'it\'s "quoted" \\ \n 日本 \U0001f600']  # the JSON text goes in a text array

    async def three(store: DjangoStore) -> list[Any]:
        return await asyncio.gather(*(store.put(("batch",), f"k{i}", tricky[i], ttl=60) for i in range(3)))

    statements.clear()
    assert [item.value for item in run(three(store))] == tricky
    assert [item.value for item in run(three(owned))] == tricky
    assert [sql for sql, _ in statements][0] == eight and len(statements) == 2
    assert [run(owned.get(("batch",), f"k{i}")).value for i in range(3)] == tricky


def test_concurrent_gets_are_one_select(statements):
    store = DjangoStore(using="postgres")
    run(store.put(("batch",), "live", 1))
    run(store.put(("batch",), "expired", 2, ttl=0))
    run(store.put(("other",), "live", 3))
    keys = [(("batch",), "live"), (("batch",), "expired"), (("batch",), "missing"), (("other",), "live")] * 2
    one_by_one = [run(store.get(*key)) for key in keys]
    statements.clear()

    async def gets() -> list[Any]:
        return await asyncio.gather(*(store.get(*key) for key in keys))

    assert run(gets()) == one_by_one
    assert len(statements) == 1
    assert [item and item.value for item in one_by_one] == [1, None, None, 3] * 2


def test_a_batch_holds_at_most_max_batch_calls(statements):
    store = DjangoStore(using="postgres")

    async def gets(count: int) -> list[Any]:
        return await asyncio.gather(*(store.get(("batch",), f"k{i}") for i in range(count)))

    assert run(gets(asyncpool.MAX_BATCH + 1)) == [None] * (asyncpool.MAX_BATCH + 1)
    assert len(statements) == 2


def test_batches_are_per_owner(statements, django_user_model):
    alice, bob = (django_user_model.objects.db_manager("postgres").create(username=name) for name in ("a", "b"))
    stores = [DjangoStore(using="postgres", owner=owner) for owner in (alice, bob, None)]

    async def puts() -> list[Any]:
        return await asyncio.gather(*(store.put(("batch",), "k", n) for n, store in enumerate(stores)))

    run(puts())
    assert len(statements) == 3
    assert [run(store.get(("batch",), "k")).value for store in stores] == [0, 1, 2]


def test_two_puts_of_one_key_in_one_turn_go_in_two_statements(statements):
    store = DjangoStore(using="postgres")

    async def puts() -> list[Any]:
        writes = [("k", 1), ("k", 2), ("j", 3)]
        return await asyncio.gather(*(store.put(("batch",), key, value) for key, value in writes))

    first, second, other = run(puts())
    assert len(statements) == 2  # one upsert cannot write a row twice
    assert run(store.get(("batch",), "k")).value == 2  # the second batch waited for the first
    assert (first.value, second.value, other.value) == (1, 2, 3)


def test_claims_are_not_batched(statements):
    store = DjangoStore(using="postgres")

    async def claims() -> list[Any]:
        return await asyncio.gather(
            *(store.put(("batch",), f"k{i}", i, if_absent=True) for i in range(3)), return_exceptions=True
        )

    assert [item.value for item in run(claims())] == [0, 1, 2]
    assert len(statements) == 3


def test_a_call_that_fails_in_a_batch_fails_alone():
    with connections["postgres"].cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION refuse_bad() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.key = 'bad' THEN RAISE EXCEPTION 'refused %', NEW.key; END IF; RETURN NEW; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER refuse_bad BEFORE INSERT OR UPDATE ON afkmemory_storeitem "
            "FOR EACH ROW EXECUTE FUNCTION refuse_bad()"
        )
    store = DjangoStore(using="postgres")

    async def puts() -> list[Any]:
        keys = ["ok1", "bad", "ok2"]
        return await asyncio.gather(*(store.put(("batch",), key, key) for key in keys), return_exceptions=True)

    try:
        ok1, bad, ok2 = run(puts())
    finally:
        with connections["postgres"].cursor() as cursor:
            cursor.execute("DROP TRIGGER refuse_bad ON afkmemory_storeitem; DROP FUNCTION refuse_bad()")
    assert (ok1.value, ok2.value) == ("ok1", "ok2")
    assert isinstance(bad, DatabaseError) and "refused bad" in str(bad)
    assert run(store.search(("batch",))) == [run(store.get(("batch",), "ok1")), run(store.get(("batch",), "ok2"))]


def test_a_cancelled_caller_leaves_the_batch_to_the_others(statements):
    store = DjangoStore(using="postgres")

    async def scenario() -> list[Any]:
        tasks = [asyncio.create_task(store.put(("batch",), f"k{i}", i)) for i in range(3)]
        await asyncio.sleep(0)  # all three have joined the batch, which has not been sent yet
        assert not statements
        tasks[1].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    first, cancelled, last = run(scenario())
    assert isinstance(cancelled, asyncio.CancelledError)
    assert (first.value, last.value) == (0, 2)
    assert len(statements) == 1  # the batch went as it was: k1 may be written, as a cancelled write may


def test_no_caller_is_left_waiting_on_a_batch():
    async def no_answers(calls: list[Any]) -> list[Any]:
        return []  # a broken send: the batch fails, then each call alone

    async def stuck(calls: list[Any]) -> list[Any]:
        await asyncio.Event().wait()
        return calls

    async def scenario() -> tuple[list[Any], list[Any]]:
        broken = asyncio.gather(
            *(asyncpool.batched("postgres", "broken", i, no_answers) for i in range(3)), return_exceptions=True
        )
        failed = await asyncio.wait_for(broken, 5)
        callers = [asyncio.create_task(asyncpool.batched("postgres", "stuck", i, stuck)) for i in range(2)]
        await asyncio.sleep(0.01)
        for task in asyncpool._pools(asyncio.get_running_loop())["postgres"].sending:
            task.cancel()  # as asyncio.run does to what is left when its main task ends
        cancelled = await asyncio.wait_for(asyncio.gather(*callers, return_exceptions=True), 5)
        return failed, cancelled

    failed, cancelled = run(scenario())
    assert [type(error) for error in failed] == [ValueError] * 3  # each call alone got no answer either
    assert [type(error) for error in cancelled] == [asyncio.CancelledError] * 2


def test_a_batch_waiting_for_an_earlier_one_still_answers_its_callers_when_cancelled():
    """A batch still waiting for an earlier batch of one of its keys, cancelled before answer() ran,
    left its caller waiting forever."""

    async def stuck(calls: list[Any]) -> list[Any]:
        await asyncio.Event().wait()
        return calls

    async def scenario() -> list[Any]:
        callers = [
            asyncio.create_task(asyncpool.batched("postgres", "stuck", n, stuck, unique="same-key"))
            for n in range(2)  # two writes of one key: two batches, the second waits for the first
        ]
        await asyncio.sleep(0.01)
        for task in asyncpool._pools(asyncio.get_running_loop())["postgres"].sending:
            task.cancel()  # as in test_no_caller_is_left_waiting_on_a_batch
        return await asyncio.wait_for(asyncio.gather(*callers, return_exceptions=True), 5)

    results = asyncio.run(scenario())
    assert [type(result) for result in results] == [asyncio.CancelledError] * 2


def _put_the_same_keys(order: str) -> int:
    """Batches of the same twenty keys, in opposite orders, from another process."""
    from django.test import override_settings

    keys = [f"k{i:02}" for i in range(20)]
    if order == "desc":
        keys.reverse()

    async def rounds() -> int:
        store = DjangoStore(using="postgres")
        for round_ in range(20):
            await asyncio.gather(*(store.put(("shared",), key, round_) for key in keys))
        return round_ + 1

    with override_settings(AFKMEMORY=POOLED):
        return asyncio.run(rounds())


@pytest.mark.slow
def test_processes_putting_the_same_keys_in_batches_do_not_deadlock():
    assert in_processes(_put_the_same_keys, [("asc",), ("desc",), ("asc",), ("desc",)]) == [20] * 4
    assert len(run(DjangoStore(using="postgres").search(("shared",)))) == 20


def test_a_batch_writes_its_rows_in_key_order(statements):
    # Two batches of the same keys lock the rows in the same order, so they cannot
    # deadlock (a deadlock would lose nothing, the batch being sent again call by call,
    # but would cost a second of deadlock_timeout).
    store = DjangoStore(using="postgres")

    async def puts() -> list[Any]:
        return await asyncio.gather(*(store.put(("batch",), f"k{i}", i) for i in reversed(range(5))))

    assert [item.key for item in run(puts())] == ["k4", "k3", "k2", "k1", "k0"]
    [(_, params)] = statements
    assert params[2] == ["k0", "k1", "k2", "k3", "k4"]  # the keys are the third parameter, an array


@pytest.mark.parametrize("prepare", [True, False])
def test_the_pools_statements_are_prepared_unless_told_not_to(settings, prepare):
    settings.AFKMEMORY = {**POOLED, "ASYNC_POOL_PREPARE": prepare}

    async def scenario() -> list[str]:
        store = DjangoStore(using="postgres")
        await store.put(("prepared",), "k", 1)
        assert (await store.get(("prepared",), "k")).value == 1
        async with asyncpool.connection("postgres") as conn:  # the one connection both calls used
            cursor = await conn.execute("SELECT statement FROM pg_prepared_statements")
            return [statement for (statement,) in await cursor.fetchall()]

    prepared = run(scenario())
    if prepare:
        assert len(prepared) == 2 and prepared[0].startswith("INSERT INTO") ^ prepared[1].startswith("INSERT INTO")
    else:
        assert prepared == []


# -- vector search on the pool ----------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [200, 0], ids=["exact", "hnsw"])
def test_vector_search_runs_on_the_pool(settings, statements, threshold):
    settings.AFKMEMORY = {**POOLED, "EXACT_SEARCH_THRESHOLD": threshold}
    memory = DjangoMemoryStore(using="postgres")
    with CaptureQueriesContext(connections["postgres"]) as hopped:
        # Its answers checked against numpy: ids, scores, the user filter, min_score, errors.
        test_memory_conformance.test_vector_search_matches_numpy_cosine(memory)
    assert not [query for query in hopped.captured_queries if "<=>" in query["sql"]]
    searches = [sql for sql, _ in statements if "<=>" in sql]
    assert len(searches) == 3  # one statement per search, whichever path it takes
    assert [sql for sql, _ in statements if sql.split()[0] in ("BEGIN", "SET", "COMMIT")] == []


def test_a_query_vector_goes_in_binary_as_float32():
    async def roundtrip(values: list[float]) -> str:
        return (await asyncpool.fetch("postgres", "SELECT %s::vector::text", [asyncpool.Vector(values)]))[0][0]

    assert run(roundtrip([1.5, -0.1, 3e-8])) == "[1.5,-0.1,3e-08]"  # the float32 nearest each number


def test_the_hnsw_settings_of_a_search_last_for_its_statement_alone(settings):
    settings.AFKMEMORY = {**POOLED, "EXACT_SEARCH_THRESHOLD": 0, "HNSW_EF_SEARCH": 77, "HNSW_MAX_SCAN_TUPLES": 1234}
    memory = DjangoMemoryStore(using="postgres")
    vector = [1.0] + [0.0] * (DIMENSIONS - 1)
    names = ["hnsw.ef_search", "hnsw.iterative_scan", "hnsw.max_scan_tuples"]
    settings_sql = "SELECT " + ", ".join(f"current_setting('{name}')" for name in names)

    async def scenario() -> tuple[tuple[Any, ...], tuple[Any, ...], int]:
        await memory.upsert_long_term_memory(test_memory_conformance.mem("m1", user="u1"), embedding=vector)
        await asyncpool.fetch("postgres", "SELECT '[1]'::vector", [])  # loads pgvector: its settings exist
        before = (await asyncpool.fetch("postgres", settings_sql, []))[0]
        hits = await memory.search_long_term_memory_vector("u1", vector, limit=5)
        assert [m.id for m, _ in hits] == ["m1"]
        after = (await asyncpool.fetch("postgres", settings_sql, []))[0]
        return before, after, len(asyncpool._pools(asyncio.get_running_loop())["postgres"].idle)

    before, after, idle = run(scenario())
    assert before == after and "77" not in before and "strict_order" not in before
    assert idle == 1  # one connection served every statement: the settings ended with the search


def test_a_pooled_hnsw_search_takes_its_settings_in_autocommit(settings):
    """``SET LOCAL`` alone does nothing in autocommit (pgvector #675); settings made inside the search do."""
    import numpy as np

    from afkmemory import indexes
    from afkmemory.stores.memory import _TableStats, _VectorSearchSQL
    from tests.test_vector_search_postgres import _exact_top, _populate, _ranking_in

    # 30 of 5,030 rows: the cost rule would rank them exactly; this test is of the HNSW path.
    settings.AFKMEMORY = {**POOLED, "EXACT_SEARCH_THRESHOLD": 10, "HNSW_EF_SEARCH": 40, "HNSW_TUPLE_COST": 0}
    rng = np.random.default_rng(44)
    small = _populate(rng)  # 30 of 5,030 rows are the user's, committed (the pool sees them)
    queries = [rng.normal(size=DIMENSIONS).astype(np.float32) for _ in range(5)]
    memory = DjangoMemoryStore(using="postgres")
    plain = (
        f"SELECT memory_id FROM afkmemory_longtermmemory WHERE user_id = 'small' AND {indexes.dimension_predicate()}"
        f" ORDER BY {indexes.embedding_sql()} <=> %s::vector LIMIT 10"
    )

    async def scenario() -> tuple[list[list[str]], list[int], str]:
        # One connection, sorting made to look expensive: the planner takes the HNSW index.
        await asyncpool.execute("postgres", "SET enable_sort = off", [])
        found = [
            [m.id for m, _ in await memory.search_long_term_memory_vector("small", q.tolist(), limit=10)]
            for q in queries
        ]
        unset = [len(await asyncpool.fetch("postgres", plain, [asyncpool.Vector(q.tolist())])) for q in queries]
        explained = await asyncpool.fetch("postgres", "EXPLAIN " + plain, [asyncpool.Vector([1.0] * DIMENSIONS)])
        # And the store's own statement, run again under EXPLAIN ANALYZE: its HNSW ranking ran, on the index.
        sql = _VectorSearchSQL.cached("postgres", None, False, True)
        assert sql is not None
        where = sql.where_params(None, "small", None, connections["postgres"])
        params = sql.params(where, asyncpool.Vector(queries[0].tolist()), 10, _TableStats(5030, hnsw=True))
        [(searched,)] = await asyncpool.fetch("postgres", "EXPLAIN (ANALYZE, FORMAT JSON) " + sql.search, params)
        assert _ranking_in(searched[0]["Plan"]) == ("hnsw", {indexes.HNSW_INDEX})
        return found, unset, "\n".join(line for (line,) in explained)

    found, unset, plan = run(scenario())
    assert indexes.HNSW_INDEX in plan
    assert min(unset) < 10  # without the iterative scan the filter leaves too few rows: the pitfall is real here
    assert all(len(hits) == 10 for hits in found)  # with it, every search fills the limit
    recalled = sum(
        len(set(hits) & {i for i, _ in _exact_top(small, q, 10)}) for hits, q in zip(found, queries, strict=True)
    )
    assert recalled >= 45, recalled


# -- found by the review of the pool: order, errors, loops, connections ----------------------------


async def _terminate(pool: Any, pid: int) -> None:
    """pg_terminate_backend(pid) from a connection of our own (not the pool's)."""
    from psycopg import AsyncConnection

    params = {k: v for k, v in pool.params.items() if k not in ("cursor_factory",)}
    async with await AsyncConnection.connect(**params) as other:
        await other.execute("SELECT pg_terminate_backend(%s)", [pid])
        # wait until the backend is really gone
        for _ in range(100):
            cur = await other.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
            if (await cur.fetchone())[0] == 0:
                break
            await asyncio.sleep(0.01)


def test_two_puts_of_one_key_keep_their_order_when_the_first_batch_is_resent():
    """put(k, 1) then put(k, 2): the last write must win, as with async_pool=False.

    The first batch (k=1, j=1) takes an idle connection the server dropped, fails, and
    is sent again call by call; meanwhile the second batch (k=2) went on another
    connection and committed first: without waiting for the first, the resent k=1 overwrote it.
    """
    store = DjangoStore(using="postgres")

    async def scenario() -> tuple[list[Any], Any]:
        await store.put(("order",), "k", 0)  # one idle connection in the pool
        pool = asyncpool._pools(asyncio.get_running_loop())["postgres"]
        [idle] = pool.idle
        await _terminate(pool, idle.info.backend_pid)
        answers = await asyncio.gather(
            store.put(("order",), "k", 1),
            store.put(("order",), "j", 1),
            store.put(("order",), "k", 2),
            return_exceptions=True,
        )
        return answers, await store.get(("order",), "k")

    finals = []
    for _ in range(10):
        answers, final = run(scenario())
        assert [a.value for a in answers] == [1, 1, 2]  # every caller was told its put was written
        finals.append(final.value)
    assert finals == [2] * 10, f"put(k, 2) came last but k held: {finals}"


def test_two_puts_of_one_key_keep_their_order_on_fresh_connections():
    """The same without a dropped connection: a fresh loop, so each batch opens its own connection."""

    def finals(store: DjangoStore) -> list[Any]:
        async def scenario() -> Any:
            await asyncio.gather(*(store.put(("order2",), "k", n) for n in range(4)))
            return (await store.get(("order2",), "k")).value

        return [run(scenario()) for _ in range(15)]

    assert finals(DjangoStore(using="postgres", async_pool=False)) == [3] * 15  # the hop: in order
    pooled = finals(DjangoStore(using="postgres"))
    assert pooled == [3] * 15, pooled


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_refuses_connections_raises_djangos_operational_error():
    settings_dict = connections["postgres"].settings_dict
    saved = dict(settings_dict)
    settings_dict.update(HOST="127.0.0.1", PORT=str(_free_port()))  # the server is down
    try:
        with pytest.raises(Exception) as raised:
            run(DjangoStore(using="postgres").get(("a",), "k"))
    finally:
        settings_dict.clear()
        settings_dict.update(saved)
    assert isinstance(raised.value, OperationalError), f"{type(raised.value).__module__}.{type(raised.value).__name__}"


def test_a_failing_assume_role_raises_a_django_error():
    options = connections["postgres"].settings_dict["OPTIONS"]
    options["assume_role"] = "no_such_role_here"
    try:
        with pytest.raises(Exception) as raised:
            run(DjangoStore(using="postgres").get(("a",), "k"))
    finally:
        del options["assume_role"]
    assert isinstance(raised.value, DatabaseError), f"{type(raised.value).__module__}.{type(raised.value).__name__}"


def test_a_loop_closes_after_many_close_async_pools():
    """A worker that drops its connections after each job: the loop's close is hooked once, not once per drop."""

    async def noop(calls: list[Any]) -> list[Any]:
        return calls

    async def jobs() -> None:
        for i in range(1200):
            assert await asyncpool.batched("postgres", "noop", i, noop) == i
            await asyncpool.close_async_pools()

    loop = asyncio.new_event_loop()
    loop.run_until_complete(jobs())
    loop.close()  # it was 1,200 nested wrappers of close(): a RecursionError, and the loop left open
    assert loop.is_closed() and asyncpool._pools(loop) == {}


def test_a_loop_dropped_without_closing_takes_its_connections_along():
    """``loop = new_event_loop(); loop.run_until_complete(...)`` and no ``close()``: nothing
    of the pool's holds the loop, so the loop and its connections are collected as they would
    be without it, and their backends leave (each such loop kept a backend for good, and about
    a hundred of them made PostgreSQL refuse "too many clients")."""
    store = DjangoStore(using="postgres")
    store.sync.put(("a",), "k", 1)
    assert run(store.get(("a",), "k")).value == 1  # its statement compiled here: the loops below never hop

    def backends() -> int:
        with connections["postgres"].cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
            return cursor.fetchone()[0]

    before = backends()
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # "connection deleted while still open": it was
            for _ in range(30):
                loop = asyncio.new_event_loop()
                loops.append(weakref.ref(loop))
                assert loop.run_until_complete(store.get(("a",), "k")).value == 1
                del loop
            gc.collect()
        alive = sum(ref() is not None for ref in loops)
        deadline = time.monotonic() + 10
        while backends() > before and time.monotonic() < deadline:  # the server sees them go
            time.sleep(0.01)
        assert (alive, backends() - before) == (0, 0)  # (loops, backends) left; it was (30, 30)
    finally:
        for ref in loops:  # only if the test failed: close what is left
            left = ref()
            if left is not None and not left.is_closed():
                left.close()


def test_a_loop_closed_while_another_loop_runs_in_its_thread_closes_its_connections():
    """A coroutine of one loop closes another, finished loop (a library's own loop, say): the
    release cannot run that loop where another runs ("Cannot run the event loop while another
    loop is running"), and its connections stayed open until the garbage collector took them."""

    async def backend() -> int:
        async with asyncpool.connection("postgres") as conn:
            return (await (await conn.execute("SELECT pg_backend_pid()")).fetchone())[0]

    async def close(loop: asyncio.AbstractEventLoop) -> None:
        loop.close()

    finished = asyncio.new_event_loop()
    try:
        pid = finished.run_until_complete(backend())
        idle = list(asyncpool._pools(finished)["postgres"].idle)
        run(close(finished))
    finally:
        if not finished.is_closed():
            finished.close()
    assert [conn.closed for conn in idle] == [True]

    def left() -> int:
        with connections["postgres"].cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
            return cursor.fetchone()[0]

    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:  # the server sees it go
        time.sleep(0.01)
    assert left() == 0


def test_a_connection_recovers_after_a_column_type_change():
    """A migration elsewhere changed a returned column's type: the statements prepared before it are prepared again."""
    store = DjangoStore(using="postgres")
    errors: list[str] = []

    async def scenario() -> None:
        from psycopg import AsyncConnection

        await store.put(("mig",), "k", 1)
        assert (await store.get(("mig",), "k")).value == 1  # prepared on the pool's one connection
        pool = asyncpool._pools(asyncio.get_running_loop())["postgres"]
        params = {k: v for k, v in pool.params.items() if k not in ("cursor_factory",)}
        async with await AsyncConnection.connect(**params) as other:  # "a migration, elsewhere"
            await other.execute("ALTER TABLE afkmemory_storeitem ALTER COLUMN expires_at TYPE timestamptz(3)")
        try:
            for _ in range(3):
                try:
                    await store.get(("mig",), "k")
                except Exception as error:  # noqa: BLE001
                    errors.append(f"{type(error).__name__}: {error}")
        finally:
            async with await AsyncConnection.connect(**params) as other:
                await other.execute("ALTER TABLE afkmemory_storeitem ALTER COLUMN expires_at TYPE timestamptz")

    run(scenario())
    assert errors == [], errors


HELD, SWITCH = 8, 1e-4


def test_many_loops_in_many_threads_register_their_pools_safely():
    """Loops in several threads (``async_to_sync`` per request) register and leave while others look their pool up."""

    async def noop(calls: list[Any]) -> list[Any]:
        return calls

    failures: list[BaseException] = []
    stop = threading.Event()
    keep_open: list[asyncio.AbstractEventLoop] = []

    async def one() -> None:
        await asyncpool.batched("postgres", "noop", 1, noop)

    # Live loops in other threads keep _pools large while new loops register.
    def hold() -> None:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(one())
        keep_open.append(loop)

    for _ in range(HELD):
        hold()

    def worker() -> None:
        try:
            while not stop.is_set():
                asyncio.run(one())
        except BaseException as error:  # noqa: BLE001
            failures.append(error)
            traceback.print_exc()
            stop.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH)
    try:
        threads = [threading.Thread(target=worker) for _ in range(6)]
        for t in threads:
            t.start()
        stop.wait(4)
        stop.set()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
        for loop in keep_open:
            loop.close()
    assert failures == [], repr(failures[:1])


def test_a_connection_given_back_out_of_autocommit_is_not_reused():
    """Else the next put on it is acknowledged, then rolled back when the connection is closed mid-transaction."""
    store = DjangoStore(using="postgres")

    async def scenario() -> Any:
        async with asyncpool.connection("postgres") as conn:
            await conn.set_autocommit(False)  # a caller's own statements; it left the connection idle
        await store.put(("ac",), "k", "written?")  # takes that connection
        return None

    run(scenario())
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SELECT count(*) FROM afkmemory_storeitem WHERE key = 'k'")
        assert cursor.fetchone()[0] == 1, "the put was acknowledged but never committed"


def test_timeouts_on_pooled_calls_leave_the_pool_consistent():
    store = DjangoStore(using="postgres")
    rng = random.Random(7)

    async def scenario() -> tuple[int, list[str], int, int]:
        await store.put(("c",), "k", 1)

        async def one(i: int) -> str:
            try:
                if i % 3 == 0:
                    sleep = asyncpool.fetch("postgres", "SELECT pg_sleep(%s)", [0.02])
                    await asyncio.wait_for(sleep, rng.random() * 0.03)
                elif i % 3 == 1:
                    await asyncio.wait_for(store.search(("c",)), rng.random() * 0.003)
                else:
                    await asyncio.wait_for(store.put(("c",), f"k{i % 7}", i), rng.random() * 0.003)
                return "ok"
            except TimeoutError:
                return "timeout"

        outcomes = await asyncio.gather(*(one(i) for i in range(200)))
        await asyncio.sleep(0.2)
        pool = asyncpool._pools(asyncio.get_running_loop())["postgres"]
        states = [asyncpool._usable(conn) and "IDLE" or str(conn.pgconn.transaction_status) for conn in pool.idle]
        # every connection still answers
        for _ in range(len(pool.idle) + 1):
            assert (await store.get(("c",), "k")).value == 1
        return pool.slots._value, states, outcomes.count("timeout"), len(pool.idle)

    free, states, timeouts, idle = run(scenario())
    assert timeouts > 0
    assert free == POOLED["ASYNC_POOL_SIZE"]
    assert all(state == "IDLE" for state in states), states
    assert idle <= POOLED["ASYNC_POOL_SIZE"]
