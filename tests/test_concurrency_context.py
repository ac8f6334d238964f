"""own_thread(): concurrent async callers run on threads of their own, and leave no connection open."""

from __future__ import annotations

import asyncio
import threading

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from afkmemory.memory import MemoryEvent
from afkmemory.stores import DjangoMemoryStore, own_thread


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@pytest.mark.parametrize("alias", ["default", "postgres"])
def test_callers_get_their_own_threads_and_close_their_connections(alias):
    store = DjangoMemoryStore(using=alias)
    seen: dict[int, tuple[str, bool]] = {}

    def where() -> tuple[str, bool]:
        # Names, not idents: an ident is reused once its thread has ended, a name is not.
        return threading.current_thread().name, connections[alias].connection is not None

    async def caller(n: int) -> None:
        async with own_thread():
            await store.append_event(MemoryEvent(f"e{n}", f"t{n}", None, "message", n, {}, []))
            seen[n] = await sync_to_async(where)()

    async def shared() -> str:
        return (await sync_to_async(where)())[0]

    async def main() -> tuple[str, int]:
        await asyncio.gather(*(caller(n) for n in range(4)))
        result = await shared(), len(await store.get_recent_events("t0"))
        await sync_to_async(connections.close_all)()  # the shared thread's own connection
        return result

    def sessions() -> set[int]:
        """The client sessions on the test database (an earlier test's may still be ending)."""
        with connections["postgres"].cursor() as cursor:
            cursor.execute(
                "SELECT pid FROM pg_stat_activity"
                " WHERE datname = current_database() AND backend_type = 'client backend'"
            )
            return {pid for (pid,) in cursor.fetchall()}

    before = sessions() if alias == "postgres" else set()
    shared_thread, events = asyncio.run(main())
    threads = {name for name, _ in seen.values()}
    assert len(threads) == 4 and shared_thread not in threads  # one thread per caller, not the shared one
    assert all(open_ for _, open_ in seen.values())  # each used a connection of its own ...
    assert events == 1
    if alias == "postgres":  # ... and closed it: no session is left that was not there before
        assert sessions() - before == set()


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@pytest.mark.parametrize(("alias", "pooled"), [("default", False), ("postgres", False), ("postgres", True)])
def test_calls_through_async_to_sync_leave_the_callers_context_as_it_was(alias, pooled):
    """Reaching ``connections[alias]`` from an event loop's thread makes asgiref a context variable,
    which ``async_to_sync`` copies back into the sync caller's context: a store that did so in the
    loop grew a worker's context by one per call, and every later ``sync_to_async`` walked them all."""
    import contextvars

    from afkmemory.memory import LongTermMemory
    from afkmemory.stores import DjangoStore
    from tests.conftest import DIMENSIONS
    from tests.utils import run

    items = DjangoStore(using=alias, async_pool=pooled)
    memory = DjangoMemoryStore(using=alias, async_pool=pooled)

    def calls(i: int) -> None:
        run(items.put(("ctx",), "k", i))
        run(items.get(("ctx",), "k"))
        run(items.search(("ctx",)))
        run(memory.append_event(MemoryEvent(f"e{i}", "t", None, "message", i, {}, [])))
        run(memory.get_recent_events("t"))
        run(memory.get_state("t", "k"))
        run(memory.upsert_long_term_memory(LongTermMemory(f"m{i}", "u"), embedding=[1.0] * DIMENSIONS))
        run(memory.search_long_term_memory_vector("u", [1.0] * DIMENSIONS))

    calls(0)  # what is made once (compiled statements, the pool's registry) is made here
    before = len(contextvars.copy_context())
    for i in range(1, 6):
        calls(i)
    assert len(contextvars.copy_context()) == before
