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

    shared_thread, events = asyncio.run(main())
    threads = {name for name, _ in seen.values()}
    assert len(threads) == 4 and shared_thread not in threads  # one thread per caller, not the shared one
    assert all(open_ for _, open_ in seen.values())  # each used a connection of its own ...
    assert events == 1
    if alias == "postgres":  # ... and closed it: only this test's own session is left
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
            assert cursor.fetchone()[0] == 1
