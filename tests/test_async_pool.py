"""The async stores on their own connections (``ASYNC_POOL``): both conformance suites again, and the pool's rules."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from agentflow.errors import StoreConflict
from django.db import ProgrammingError, connections
from django.test.utils import CaptureQueriesContext

from afkmemory.memory import MemoryEvent
from afkmemory.stores import DjangoMemoryStore, DjangoStore, asyncpool
from tests import test_memory_conformance, test_store_conformance
from tests.conftest import DIMENSIONS
from tests.utils import in_processes, run

# The pool's connections commit each statement: the tests must not hide rows in a transaction.
pytestmark = pytest.mark.django_db(databases=["default", "postgres"], transaction=True)

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
        pool = asyncpool._pools[asyncio.get_running_loop()]["postgres"]
        return one_by_one, len(set(at_once)), list(pool.idle)

    one_by_one, distinct, idle = run(scenario())
    assert len(set(one_by_one)) == 1  # one caller at a time: one connection, reused
    assert distinct == POOLED["ASYNC_POOL_SIZE"]  # twelve callers share the four the size allows
    assert len(idle) == POOLED["ASYNC_POOL_SIZE"]
    assert all(conn.closed for conn in idle)  # async_to_sync's loop closed: so did they
    assert not [loop for loop in asyncpool._pools if loop.is_closed()]


def test_close_async_pools_closes_the_loops_connections():
    async def scenario() -> list[Any]:
        await DjangoStore(using="postgres").get(("a",), "k")
        idle = list(asyncpool._pools[asyncio.get_running_loop()]["postgres"].idle)
        await asyncpool.close_async_pools()
        assert asyncio.get_running_loop() not in asyncpool._pools
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
        pool = asyncpool._pools[asyncio.get_running_loop()]["postgres"]
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
