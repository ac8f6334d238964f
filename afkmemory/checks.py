"""System checks for afkmemory's settings and, with ``check --database`` and ``migrate``, its databases."""

from __future__ import annotations

import zoneinfo
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, router
from django.db.migrations.recorder import MigrationRecorder
from django.db.utils import load_backend

from . import indexes
from .conf import DEFAULTS, WHOLE_NUMBERS, afk_settings, user_settings
from .memory import factory
from .memory.types import RetentionPolicy, StateRetentionPolicy
from .stores.checkpoints import CheckpointRetention


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """Refuse settings the indexes, searches, jobs or API cannot run with; warn about unknown keys."""
    problems: list[Any] = []
    try:
        user = user_settings()
    except ImproperlyConfigured as exc:
        return [Error(str(exc), hint="See afkmemory/conf.py.", id="afkmemory.E000")]
    readers = (("afkmemory.E001", indexes.embedding_dimensions), ("afkmemory.E002", indexes.text_search_config))
    for check_id, read in readers:
        try:
            read()
        except ValueError as exc:
            problems.append(Error(str(exc), hint="Fix it in settings.AFKMEMORY.", id=check_id))
    for name, (_low, _high, meaning) in WHOLE_NUMBERS.items():
        try:
            afk_settings.whole_number(name)
        except ImproperlyConfigured as exc:
            problems.append(
                Error(
                    str(exc),
                    hint=f"It is {meaning} (default {DEFAULTS[name]!r}).",
                    id="afkmemory.E003" if name == "ASYNC_POOL_SIZE" else "afkmemory.E006",
                )
            )
    policies = (
        ("COMPACTION_POLICY", RetentionPolicy, "max_events_per_thread, keep_event_types, scan_limit"),
        (
            "STATE_RETENTION_POLICY",
            StateRetentionPolicy,
            "max_runs, max_runtime_states_per_run, max_effect_entries_per_run, always_keep_phases, "
            "keep_state_prefixes; or None to keep every checkpoint",
        ),
        ("GRAPH_CHECKPOINT_RETENTION", CheckpointRetention, "keep_steps, max_age_days; or None to keep them all"),
    )
    for name, policy_class, fields in policies:
        value = getattr(afk_settings, name)
        if value is None and policy_class is not RetentionPolicy:  # the retention policies: None keeps all
            continue
        try:
            policy_class(**value)
        except (TypeError, ValueError) as exc:
            problems.append(
                Error(
                    f"AFKMEMORY[{name!r}] is not a {policy_class.__name__}: {exc}.",
                    hint=f"A dict of its fields: {fields}.",
                    id="afkmemory.E007",
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
    for problem in factory.settings_problems():
        problems.append(
            Error(
                f"create_memory_store() cannot start with these settings: {problem}.",
                hint="Fix AFKMEMORY['BACKEND'...'REDIS_...'] or the AFK_* environment variable that overrides it.",
                id="afkmemory.E008",
            )
        )
    alias = afk_settings.DATABASE_ALIAS
    if alias not in connections.settings:
        problems.append(
            Error(
                f"AFKMEMORY['DATABASE_ALIAS'] is {alias!r}, which settings.DATABASES does not have.",
                hint=f"The database of the REST API and the scheduled jobs: one of {sorted(connections.settings)}.",
                id="afkmemory.E009",
            )
        )
    elif not router.allow_migrate(alias, "afkmemory"):
        problems.append(
            Error(
                f"AFKMEMORY['DATABASE_ALIAS'] is {alias!r}, where DATABASE_ROUTERS do not let afkmemory's "
                "tables be created: the REST API, the scheduled jobs and the commands would find none.",
                hint="Set it to the database your router sends afkmemory's models to.",
                id="afkmemory.E011",
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


def _wrapper(database: dict[str, Any]) -> Any | None:
    """The ``DatabaseWrapper`` class of ``database`` (a ``DATABASES`` entry); None if it cannot be loaded.

    Read from the settings, without a connection: the checks look at ``DATABASES`` as it is
    now, and Django reports a backend it cannot load itself.
    """
    try:
        return load_backend(database.get("ENGINE") or "django.db.backends.dummy").DatabaseWrapper
    except ImproperlyConfigured:
        return None


def _is_sqlite(database: dict[str, Any]) -> bool:
    """Whether ``database`` is on Django's SQLite backend or one built on it."""
    wrapper = _wrapper(database)
    return wrapper is not None and wrapper.vendor == "sqlite"


@register()
def check_sqlite_transactions(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """Warn about a SQLite database whose transactions take the write lock only at their first write.

    A compaction or a claim reads, then writes; under SQLite's default ``DEFERRED``
    transactions, a writer that came first in between makes that write fail with
    "database is locked" rather than wait its turn.
    """
    return [
        Warning(
            f"SQLite database {alias!r} opens its transactions DEFERRED: compactions and claims can "
            "fail with 'database is locked' while another process writes.",
            hint=f'Set DATABASES[{alias!r}]["OPTIONS"]["transaction_mode"] = "IMMEDIATE".',
            id="afkmemory.W005",
        )
        for alias, database in settings.DATABASES.items()
        if _is_sqlite(database)
        and router.allow_migrate(alias, "afkmemory")  # a database afkmemory never writes is the project's own
        # Django upper-cases the mode: "immediate" opens BEGIN IMMEDIATE too.
        and str((database.get("OPTIONS") or {}).get("transaction_mode")).upper() not in ("IMMEDIATE", "EXCLUSIVE")
    ]


def _changes_offset(zone_name: str) -> bool:
    """Whether time zone ``zone_name`` moves its UTC offset during the year (daylight saving)."""
    try:
        zone = zoneinfo.ZoneInfo(zone_name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):  # Django refuses an unknown TIME_ZONE itself
        return False
    year = datetime.now().year
    return len({datetime(year, month, 1, tzinfo=zone).utcoffset() for month in range(1, 13)}) > 1


def _keeps_instants(database: dict[str, Any]) -> bool:
    """Whether ``database`` stores aware datetimes as instants, not local times."""
    wrapper = _wrapper(database)
    return wrapper is None or bool(wrapper.features_class.supports_timezones)


@register()
def check_local_times(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """Warn where afkmemory's times are stored as local times of a zone with daylight saving.

    With ``USE_TZ = False``, or on SQLite with a ``TIME_ZONE`` of the database's own, a
    time is written as the zone's wall clock: a TTL or a job's lease that spans a change of
    the clocks is an hour short or long, and in the hour that repeats an expired item
    comes back.
    """
    problems = []
    for alias, database in settings.DATABASES.items():
        if not router.allow_migrate(alias, "afkmemory"):
            continue
        zone: str | None
        if not settings.USE_TZ:
            zone = settings.TIME_ZONE
        elif not _keeps_instants(database):
            zone = database.get("TIME_ZONE")
        else:  # PostgreSQL: timestamptz holds the instant, whatever the connection's zone
            continue
        if zone and _changes_offset(zone):
            where = "USE_TZ is False" if not settings.USE_TZ else f"DATABASES[{alias!r}]['TIME_ZONE'] is set"
            problems.append(
                Warning(
                    f"Database {alias!r} stores afkmemory's times as local times of {zone!r} ({where}), "
                    "which changes its clocks: TTLs and job leases across a change are an hour off, "
                    "and an expired item can come back in the hour that repeats.",
                    hint="Set USE_TZ = True and leave the database's TIME_ZONE unset (times stored in UTC), "
                    "or use a zone without daylight saving such as 'UTC'.",
                    id="afkmemory.W008",
                )
            )
    return problems


@contextmanager
def _savepoint(connection: Any) -> Iterator[None]:
    """A savepoint when ``connection`` is in a transaction (a test's, a caller's, autocommit turned
    off), so that a check's query that fails (a role that may not read a catalog or
    ``django_migrations``) leaves it usable."""
    if connection.get_autocommit():
        yield
        return
    savepoint = connection.savepoint()
    try:
        yield
    except BaseException:
        connection.savepoint_rollback(savepoint)
        raise
    connection.savepoint_commit(savepoint)


#: The search indexes a migrated database has: the migration that made each, the check that
#: warns when it is missing, and what search does without it.
INDEXES_SINCE = {
    indexes.HNSW_INDEX: ("0001_initial", "afkmemory.W002", "vector search ranks every candidate exactly"),
    indexes.VECTOR_GIN_INDEX: (
        "0009_memory_search_vector_index",
        "afkmemory.W007",
        "text search reads every memory of the user, or of the account",
    ),
}


@register(Tags.database)
def check_search_indexes(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[Any]:
    """On PostgreSQL: refuse a ``TEXT_SEARCH_CONFIG`` the database does not have; warn when the
    HNSW index or the text search index is missing or invalid, or was built for another
    embedding dimension, or the stored text search vectors are in another configuration.

    Not on a database the routers keep afkmemory's tables out of (Django records its
    migrations there as applied all the same).
    """
    problems: list[Any] = []
    for alias in databases or []:
        connection = connections[alias]
        if connection.vendor != "postgresql" or not router.allow_migrate(alias, "afkmemory"):
            continue
        try:
            with _savepoint(connection), connection.cursor() as cursor:
                unknown = indexes.unknown_text_search_config(cursor)
                cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = %s", [indexes.HNSW_INDEX])
                row = cursor.fetchone()
                vectors_config = indexes.trigger_config(cursor)
                states = {name: indexes.index_state(cursor, name) for name in INDEXES_SINCE}
                applied = MigrationRecorder(connection).applied_migrations()
            expected = indexes.embedding_sql()
            config = indexes.text_search_config()
        except (DatabaseError, ValueError):
            continue  # not migrated yet, or a settings error reported by check_settings
        if unknown:
            hint = "Fix it in settings.AFKMEMORY (or create the configuration in that database)."
            problems.append(Error(f"{unknown}, on database {alias!r}.", hint=hint, id="afkmemory.E012"))
        for name, (migration, check_id, without) in INDEXES_SINCE.items():
            if states[name] != "valid" and ("afkmemory", migration) in applied:
                state = "missing" if states[name] is None else "invalid (a concurrent build was interrupted)"
                problems.append(
                    Warning(
                        f"The index {name} on database {alias!r} is {state}: {without}.",
                        hint="Run `python manage.py afkmemory_rebuild_indexes --concurrently` to build it online.",
                        id=check_id,
                    )
                )
        if vectors_config is not None and vectors_config != config:
            problems.append(
                Warning(
                    f"The stored text search vectors on database {alias!r} are in configuration "
                    f"{vectors_config!r}, not TEXT_SEARCH_CONFIG {config!r}: text search parses every "
                    "matching memory's text until they are rebuilt.",
                    hint="Run `python manage.py afkmemory_rebuild_indexes` after changing TEXT_SEARCH_CONFIG.",
                    id="afkmemory.W007",
                )
            )
        if row is not None and f"vector({indexes.embedding_dimensions()})" not in row[0]:
            problems.append(
                Warning(
                    f"The HNSW index on database {alias!r} was not built for {expected}: {row[0]}",
                    hint="Run `python manage.py afkmemory_rebuild_indexes` after changing EMBEDDING_DIMENSIONS.",
                    id="afkmemory.W002",
                )
            )
    return problems


#: The oldest pgvector afkmemory's migrations work with: its first with HNSW indexes.
MIN_PGVECTOR = (0, 5)
_MIN_PGVECTOR_TEXT = ".".join(map(str, MIN_PGVECTOR))


def pgvector_problem(
    alias: str, installed: str | None, available: str | None, major: int | None, creatable: bool = True
) -> Error | Warning | None:
    """Return what keeps afkmemory's migrations from running on ``alias``, given its pgvector versions.

    ``installed`` is the extension's version in the database, ``available`` the one the
    server would create, ``major`` the server's major version (for its package's name),
    ``creatable`` whether the connection's role may create the extension there.
    """
    package = (
        f"Debian and Ubuntu: the postgresql-{major or 'NN'}-pgvector package, from apt.postgresql.org where "
        "the distribution has none; elsewhere see https://github.com/pgvector/pgvector#installation"
    )
    version = installed or available
    if version is None:
        return Error(
            f"The PostgreSQL server of database {alias!r} does not have pgvector: afkmemory's "
            "first migration cannot create the vector extension there.",
            hint=(
                f"Install pgvector {_MIN_PGVECTOR_TEXT} or newer on the database server ({package}). "
                "`migrate` then creates the extension in the database; that takes a superuser, unless one "
                "has run CREATE EXTENSION vector there already."
            ),
            id="afkmemory.E010",
        )
    try:
        too_old = tuple(int(part) for part in version.split(".")[:2]) < MIN_PGVECTOR
    except ValueError:
        too_old = False  # a version of another form: let the migration tell
    if not too_old and (installed or creatable):
        return None
    if not too_old:  # migrate would apply Django's own migrations, then stop on CREATE EXTENSION
        # A warning, not an error: managed services let an administrator role that is no
        # superuser create the extensions they support, which the catalog does not show.
        return Warning(
            f"Database {alias!r} connects as a role that is no superuser, and pgvector is not a trusted "
            "extension: afkmemory's first migration, which creates it, may fail after Django's own "
            "migrations are applied.",
            hint="Unless the role may create it some other way (a managed service's administrator role, such as "
            "rds_superuser or cloudsqlsuperuser), run CREATE EXTENSION vector; in that database as a superuser first.",
            id="afkmemory.W009",
        )
    update = "then, as a superuser, ALTER EXTENSION vector UPDATE in the database" if installed else "then `migrate`"
    return Error(
        f"Database {alias!r} has pgvector {version}, which has no HNSW index: afkmemory's migrations "
        f"need {_MIN_PGVECTOR_TEXT} or newer.",
        hint=f"Install a newer pgvector on the database server ({package}); {update}.",
        id="afkmemory.E010",
    )


@register(Tags.database)
def check_pgvector(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[Any]:
    """Refuse a PostgreSQL database whose server lacks pgvector 0.5+, before ``migrate`` fails on it.

    ``migrate`` runs this for its database first: without it, afkmemory's first migration
    stops on ``CREATE EXTENSION vector`` (or on its HNSW index) with a long traceback. Only
    the server can provide the extension: its files are installed with PostgreSQL, not
    with Python packages.
    """
    problems: list[Any] = []
    for alias in databases or []:
        connection = connections[alias]
        # A PostgreSQL database the project's routers keep afkmemory out of needs no pgvector.
        if connection.vendor != "postgresql" or not router.allow_migrate(alias, "afkmemory"):
            continue
        try:
            with _savepoint(connection), connection.cursor() as cursor:
                cursor.execute(
                    "SELECT (SELECT extversion FROM pg_extension WHERE extname = 'vector'), "
                    "(SELECT default_version FROM pg_available_extensions WHERE name = 'vector'), "
                    "current_setting('server_version_num')::int / 10000, "
                    # Whether CREATE EXTENSION would be allowed: a superuser, or a trusted
                    # extension and the CREATE privilege on the database.
                    "coalesce((SELECT rolsuper FROM pg_roles WHERE rolname = current_user), false) OR ("
                    " coalesce((SELECT v.trusted FROM pg_available_extension_versions v"
                    " JOIN pg_available_extensions e ON e.name = v.name AND e.default_version = v.version"
                    " WHERE v.name = 'vector'), false)"
                    " AND has_database_privilege(current_database(), 'CREATE'))"
                )
                row = cursor.fetchone()
        except DatabaseError:
            continue  # unreachable: migrate, or whatever needs the database, says so itself
        problem = pgvector_problem(alias, *row) if row is not None else None
        if problem is not None:
            problems.append(problem)
    return problems


@register(Tags.urls)
def check_api_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """Warn when the REST API is routed under settings its schema endpoints cannot work with."""
    from django.apps import apps
    from django.urls import NoReverseMatch, reverse

    if not getattr(settings, "ROOT_URLCONF", None):  # a settings module for workers: Django's check allows it
        return []
    try:
        reverse("afkmemory_api:schema")
    except NoReverseMatch:
        return []  # the API is not routed in this project
    from drf_spectacular.openapi import AutoSchema
    from rest_framework.settings import api_settings

    problems: list[Any] = []
    if not (
        isinstance(api_settings.DEFAULT_SCHEMA_CLASS, type)
        and issubclass(api_settings.DEFAULT_SCHEMA_CLASS, AutoSchema)
    ):
        problems.append(
            Warning(
                "REST_FRAMEWORK['DEFAULT_SCHEMA_CLASS'] is not drf-spectacular's AutoSchema: "
                "afkmemory's schema/ endpoint will fail.",
                hint='Set it to "drf_spectacular.openapi.AutoSchema" (README, "Installing the app in your project").',
                id="afkmemory.W004",
            )
        )
    # The docs page renders drf-spectacular's template, found only in an installed app: without
    # it schema/docs/ answers 500 (TemplateDoesNotExist) while everything else works.
    if not apps.is_installed("drf_spectacular"):
        problems.append(
            Warning(
                "'drf_spectacular' is not in INSTALLED_APPS: afkmemory's schema/docs/ page will fail.",
                hint='Add "drf_spectacular" to INSTALLED_APPS (README, "Installing the app in your project").',
                id="afkmemory.W006",
            )
        )
    return problems
