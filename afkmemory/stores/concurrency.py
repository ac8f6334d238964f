"""How the async stores reach their sync logic: one thread hop per call, a thread per concurrent caller."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

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


@functools.cache
def hop(function: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``sync_to_async(function)``, built once per function.

    The async stores call their sync store's method through it: building the wrapper on
    every call cost about 0.1 ms (asgiref inspects the function), a tenth of a store call.
    Pass the sync store explicitly: ``await hop(type(self.sync).get)(self.sync, ...)``.
    """
    return sync_to_async(function)
