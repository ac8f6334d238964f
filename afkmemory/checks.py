"""System checks for afkmemory's settings and, with ``check --database``, its search indexes."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register
from django.db import DatabaseError, connections

from . import indexes
from .conf import DEFAULTS, afk_settings


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """Refuse settings the search indexes cannot be built from; warn about unknown keys."""
    problems: list[Any] = []
    user = getattr(settings, "AFKMEMORY", {}) or {}
    if not isinstance(user, dict):
        return [Error("settings.AFKMEMORY must be a dict.", hint="See afkmemory/conf.py.", id="afkmemory.E000")]
    readers = (("afkmemory.E001", indexes.embedding_dimensions), ("afkmemory.E002", indexes.text_search_config))
    for check_id, read in readers:
        try:
            read()
        except ValueError as exc:
            problems.append(Error(str(exc), hint="Fix it in settings.AFKMEMORY.", id=check_id))
    size = afk_settings.ASYNC_POOL_SIZE
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        problems.append(
            Error(
                f"AFKMEMORY['ASYNC_POOL_SIZE'] must be a whole number of connections >= 1, got {size!r}.",
                hint="It caps the async stores' own connections per event loop and database (default 10).",
                id="afkmemory.E003",
            )
        )
    switches = (
        (
            "ASYNC_POOL",
            "afkmemory.E004",
            "True sends the async stores' hot calls on PostgreSQL through their own connections.",
        ),
        ("ASYNC_POOL_PREPARE", "afkmemory.E005", "False sends the pool's statements unprepared (old PgBouncer)."),
    )
    for name, check_id, hint in switches:
        value = getattr(afk_settings, name)
        if not isinstance(value, bool):
            problems.append(Error(f"AFKMEMORY[{name!r}] must be True or False, got {value!r}.", hint=hint, id=check_id))
    if afk_settings.ASYNC_POOL is True and not any(connections[alias].vendor == "postgresql" for alias in connections):
        problems.append(
            Warning(
                "AFKMEMORY['ASYNC_POOL'] is on, but no database is PostgreSQL: it has no effect.",
                hint="The async pool is for PostgreSQL; remove the setting.",
                id="afkmemory.W003",
            )
        )
    for key in sorted(set(user) - set(DEFAULTS)):
        problems.append(
            Warning(
                f"settings.AFKMEMORY has an unknown key {key!r}; it is ignored.",
                hint=f"Known keys: {', '.join(sorted(DEFAULTS))}.",
                id="afkmemory.W001",
            )
        )
    return problems


@register(Tags.database)
def check_search_indexes(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[Any]:
    """Warn when a PostgreSQL HNSW index was built for another embedding dimension."""
    problems: list[Any] = []
    for alias in databases or []:
        connection = connections[alias]
        if connection.vendor != "postgresql":
            continue
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = %s", [indexes.HNSW_INDEX])
                row = cursor.fetchone()
            expected = indexes.embedding_sql()
        except (DatabaseError, ValueError):
            continue  # not migrated yet, or a settings error reported by check_settings
        if row is not None and f"vector({indexes.embedding_dimensions()})" not in row[0]:
            problems.append(
                Warning(
                    f"The HNSW index on database {alias!r} was not built for {expected}: {row[0]}",
                    hint="Run `python manage.py afkmemory_rebuild_indexes` after changing EMBEDDING_DIMENSIONS.",
                    id="afkmemory.W002",
                )
            )
    return problems
