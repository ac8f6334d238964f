"""Helpers for tests: run a coroutine from a sync test, run code in other processes."""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from asgiref.sync import async_to_sync

T = TypeVar("T")

#: The apps a transactional test's teardown flushes (``django_db(..., available_apps=FLUSHED_APPS)``):
#: the memory's tables and the accounts that own rows in them. Without it Django truncates every
#: installed app's tables, then creates all their content types and permissions again: a
#: quarter of a second per test, most of the pool and differential suites' time.
FLUSHED_APPS = ["afkmemory", "django.contrib.auth"]


def run(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` from a sync test.

    ``async_to_sync`` makes this thread the one ``sync_to_async(thread_sensitive=True)``
    runs on, so ORM calls inside a store see the test's own database transaction.
    """

    async def wait() -> T:
        return await awaitable

    return async_to_sync(wait)()


def _child_init(databases_json: str) -> None:
    os.environ["AFKMEMORY_TEST_DATABASES"] = databases_json
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    import django

    django.setup()


def in_processes(target: Callable[..., T], args: Sequence[tuple[Any, ...]], *, timeout: float = 120) -> list[T]:
    """Run ``target(*a)`` for each ``a`` in ``args``, each in its own fresh process, all at once.

    The children use the parent's test databases (the names Django gave them), so call
    this from a ``transaction=True`` test: they only see what the parent committed.
    ``target`` must be importable (a module-level function).
    """
    from django.conf import settings

    databases = json.dumps(settings.DATABASES, default=str)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(len(args), initializer=_child_init, initargs=(databases,)) as pool:
        pending = [pool.apply_async(target, a) for a in args]
        return [p.get(timeout=timeout) for p in pending]


def typed(value: Any) -> Any:
    """A representation of a JSON value that tells types apart (1 vs 1.0 vs True, list vs tuple)."""
    if isinstance(value, dict):
        return ("dict", sorted((k, typed(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [typed(v) for v in value])
    return (type(value).__name__, value)
