"""A thread and a database connection of its own for each concurrent async caller."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.db import connections


@asynccontextmanager
async def own_thread() -> AsyncIterator[None]:
    """Run the Django stores' calls made inside on a thread (and connection) of their own.

    Outside a Django request, every ``sync_to_async`` call of a process runs on one shared
    thread, so concurrent agent runs queue behind each other. Wrap each run::

        async with own_thread():
            await store.append_event(...)

    Inside a request Django already gives each request such a context; this is for agent
    runners, workers and scripts. The connections the thread opened are closed on exit.
    """
    async with ThreadSensitiveContext():
        try:
            yield
        finally:
            await sync_to_async(connections.close_all)()
