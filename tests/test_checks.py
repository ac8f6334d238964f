"""System checks and the index rebuild command."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from io import StringIO
from pathlib import Path

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connections
from django.db.utils import ConnectionHandler
from django.test import override_settings

from afkmemory import checks, indexes
from afkmemory.memory import LongTermMemory
from afkmemory.stores import SyncDjangoMemoryStore
from tests.conftest import DIMENSIONS


@pytest.mark.parametrize(("setting", "check_id"), [({"EMBEDDING_DIMENSIONS": 0}, "afkmemory.E001"),
                                                  ({"EMBEDDING_DIMENSIONS": "8"}, "afkmemory.E001"),
                                                  ({"TEXT_SEARCH_CONFIG": "english'; drop"}, "afkmemory.E002"),
                                                  ({"EMBEDING_DIMENSIONS": 8}, "afkmemory.W001"),
                                                  ({"ASYNC_POOL_SIZE": 0}, "afkmemory.E003"),
                                                  ({"ASYNC_POOL_SIZE": "8"}, "afkmemory.E003"),
                                                  ({"ASYNC_POOL": "yes"}, "afkmemory.E004"),
                                                  ({"ASYNC_POOL_PREPARE": 1}, "afkmemory.E005"),
                                                  ({"HNSW_EF_SEARCH": 5000}, "afkmemory.E006"),
                                                  ({"HNSW_M": 1}, "afkmemory.E006"),
                                                  ({"HNSW_EF_CONSTRUCTION": 2000}, "afkmemory.E006"),
                                                  ({"HNSW_MAX_SCAN_TUPLES": 0}, "afkmemory.E006"),
                                                  ({"EXACT_SEARCH_THRESHOLD": -1}, "afkmemory.E006"),
                                                  ({"HNSW_TUPLE_COST": -1}, "afkmemory.E006"),
                                                  ({"HNSW_TUPLE_COST": 10_001}, "afkmemory.E006"),
                                                  ({"DELETE_BATCH_SIZE": 0}, "afkmemory.E006"),
                                                  ({"DELETE_BATCH_SIZE": "500"}, "afkmemory.E006"),
                                                  ({"JOB_LEASE_SECONDS": 0.5}, "afkmemory.E006"),
                                                  ({"API_MAX_PAGE_SIZE": True}, "afkmemory.E006"),
                                                  ({"API_MAX_VALUE_BYTES": 0}, "afkmemory.E006"),
                                                  ({"API_MAX_JSON_VALUES": 0}, "afkmemory.E006"),
                                                  ({"COMPACTION_POLICY": {"max_events": 10}}, "afkmemory.E007"),
                                                  ({"COMPACTION_POLICY": {"scan_limit": 0}}, "afkmemory.E007"),
                                                  ({"STATE_RETENTION_POLICY": {"max_run": 1}}, "afkmemory.E007"),
                                                  ({"STATE_RETENTION_POLICY": []}, "afkmemory.E007"),
                                                  ({"GRAPH_CHECKPOINT_RETENTION": {"keep_steps": 0}}, "afkmemory.E007"),
                                                  ({"GRAPH_CHECKPOINT_RETENTION": [30]}, "afkmemory.E007"),
                                                  ({"GRAPH_CHECKPOINT_RETENTION": {"max_age": 1}}, "afkmemory.E007"),
                                                  ({"BACKEND": "djnago"}, "afkmemory.E008"),
                                                  ({"BACKEND_FALLBACK": "false"}, "afkmemory.E008"),
                                                  ({"REDIS_THREAD_TTL": "abc"}, "afkmemory.E008"),
                                                  ({"REDIS_MAX_CONNECTIONS": -1}, "afkmemory.E008"),
                                                  ({"REDIS_URL": "http://cache:6379/0"}, "afkmemory.E008"),
                                                  ({"DATABASE_ALIAS": "replica"}, "afkmemory.E009"),
                                                  ])  # fmt: skip
def test_bad_settings_are_reported_with_a_hint(setting, check_id):
    with override_settings(AFKMEMORY=setting):
        found = checks.check_settings()
    assert check_id in [p.id for p in found]
    assert all(p.hint for p in found)


@pytest.mark.parametrize("setting", [[], (), 0, None, "", ["x"], "abc"])
def test_settings_that_are_not_a_dict_are_reported(setting):
    """An empty list, 0 or None passed the check as no settings ("or {}"), and a non-empty list
    failed later on ``.get``: each is E000, and reading a setting names the problem too."""
    from django.core.exceptions import ImproperlyConfigured

    from afkmemory.conf import AfkMemorySettings

    with override_settings(AFKMEMORY=setting):
        [problem] = checks.check_settings()
        assert problem.id == "afkmemory.E000" and "must be a dict" in problem.msg
        with pytest.raises(ImproperlyConfigured, match="AFKMEMORY must be a dict"):
            AfkMemorySettings().whole_number("DELETE_BATCH_SIZE")


def test_default_settings_pass():
    assert checks.check_settings() == []
    for retention in ("STATE_RETENTION_POLICY", "GRAPH_CHECKPOINT_RETENTION"):
        with override_settings(AFKMEMORY={retention: None}):  # keep every checkpoint: allowed
            assert checks.check_settings() == []


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")  # read by the check alone
def test_a_sqlite_database_with_deferred_transactions_is_pointed_out(settings):
    assert checks.check_sqlite_transactions() == []  # the test settings open them IMMEDIATE
    settings.DATABASES = {**settings.DATABASES, "other": {"ENGINE": "django.db.backends.sqlite3", "NAME": "x"}}
    [problem] = checks.check_sqlite_transactions()
    assert problem.id == "afkmemory.W005" and "'other'" in problem.msg and "IMMEDIATE" in problem.hint
    for mode in ("immediate", "Exclusive"):  # Django upper-cases it
        other = {"ENGINE": "django.db.backends.sqlite3", "NAME": "x", "OPTIONS": {"transaction_mode": mode}}
        settings.DATABASES = {**settings.DATABASES, "other": other}
        assert checks.check_sqlite_transactions() == []


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")  # read by the check alone
def test_local_times_in_a_zone_with_daylight_saving_are_pointed_out(settings):
    assert checks.check_local_times() == []  # USE_TZ, times in UTC
    settings.USE_TZ, settings.TIME_ZONE = False, "America/New_York"
    problems = checks.check_local_times()
    assert {p.id for p in problems} == {"afkmemory.W008"}
    assert {"'default'", "'postgres'"} <= {p.msg.split()[1] for p in problems}  # each database afkmemory is on
    assert "USE_TZ is False" in problems[0].msg and "USE_TZ = True" in problems[0].hint
    settings.TIME_ZONE = "Asia/Tokyo"  # no daylight saving: wall-clock time is as good as UTC
    assert checks.check_local_times() == []
    settings.USE_TZ, settings.TIME_ZONE = True, "America/New_York"
    assert checks.check_local_times() == []  # stored in UTC, shown in New York's time
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": "x", "TIME_ZONE": "Europe/Paris"}
    settings.DATABASES = {**settings.DATABASES, "other": sqlite}
    [problem] = checks.check_local_times()
    assert "'other'" in problem.msg and "'Europe/Paris'" in problem.msg and "TIME_ZONE'] is set" in problem.msg
    # PostgreSQL with a TIME_ZONE of its own: timestamptz stores the instant, whatever the zone.
    postgres = {**settings.DATABASES["postgres"], "TIME_ZONE": "Europe/Paris"}
    settings.DATABASES = {**settings.DATABASES, "other": sqlite | {"TIME_ZONE": None}, "postgres": postgres}
    assert checks.check_local_times() == []


def test_the_backend_settings_are_checked_under_afks_environment_variables(monkeypatch):
    """What create_memory_store() would refuse is found at start-up; the environment wins there too."""
    monkeypatch.setenv("AFK_MEMORY_BACKEND", "reddis")
    [problem] = checks.check_settings()
    assert problem.id == "afkmemory.E008" and "unknown memory backend 'reddis'" in problem.msg
    monkeypatch.setenv("AFK_MEMORY_BACKEND", "redis")
    monkeypatch.setenv("AFK_REDIS_THREAD_TTL", "abc")
    [problem] = checks.check_settings()
    assert problem.id == "afkmemory.E008" and "AFK_REDIS_THREAD_TTL='abc' is invalid" in problem.msg


def test_a_job_lease_no_claim_can_be_written_with_is_refused():
    """A lease past the year 9999 made every job's claim fail, so beat's jobs never ran."""
    with override_settings(AFKMEMORY={"JOB_LEASE_SECONDS": 10**12}):
        [problem] = checks.check_settings()
    assert problem.id == "afkmemory.E006" and "from 1 to 31622400" in problem.msg


def test_a_range_error_names_the_setting_and_its_bounds():
    with override_settings(AFKMEMORY={"HNSW_EF_SEARCH": 5000}):
        [problem] = checks.check_settings()
    assert problem.msg == "AFKMEMORY['HNSW_EF_SEARCH'] must be a whole number from 1 to 1000, got 5000."
    assert "default 100" in problem.hint


def test_the_async_pool_without_postgresql_is_pointed_out(settings, monkeypatch):
    settings.AFKMEMORY = {"EMBEDDING_DIMENSIONS": DIMENSIONS, "ASYNC_POOL": True}
    assert checks.check_settings() == []  # the test settings have a PostgreSQL database
    sqlite_only = ConnectionHandler({"default": settings.DATABASES["default"]})
    monkeypatch.setattr(checks, "connections", sqlite_only)
    assert [p.id for p in checks.check_settings()] == ["afkmemory.W003"]


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("alias", ["default", "postgres"])
def test_rebuild_after_a_dimension_change(alias):
    store = SyncDjangoMemoryStore(using=alias)
    store.upsert_long_term_memory(LongTermMemory("old", "u"), embedding=[1.0] * DIMENSIONS)
    assert checks.check_search_indexes(databases=[alias]) == []
    if alias == "postgres":  # run the insert's deferred FK checks now, as a commit would, before DDL
        with connections[alias].cursor() as cursor:
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": 16}):
        if alias == "postgres":
            assert [p.id for p in checks.check_search_indexes(databases=[alias])] == ["afkmemory.W002"]
        out = StringIO()
        call_command("afkmemory_rebuild_indexes", database=alias, stdout=out)
        assert "1 memories have embeddings that are not 16-dimensional" in out.getvalue()
        assert checks.check_search_indexes(databases=[alias]) == []
        store.upsert_long_term_memory(LongTermMemory("new", "u", text="fresh"), embedding=[0.5] * 16)
        hits = store.search_long_term_memory_vector("u", [0.5] * 16)
        assert [m.id for m, _ in hits] == ["new"]  # the old 8-dimensional vector is ignored, not an error
        assert [m.id for m in store.search_long_term_memory_text("u", "fresh")] == ["new"]
        call_command("afkmemory_rebuild_indexes", database=alias, clear_mismatched_embeddings=True, stdout=out)
        assert "Cleared 1 mismatched embeddings" in out.getvalue()
    if alias == "postgres":
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = %s", [indexes.HNSW_INDEX])
            assert "vector(16)" in cursor.fetchone()[0]


def test_a_settings_module_without_urls_passes_the_api_check(settings):
    """A Celery worker's settings may have no ROOT_URLCONF: the check raised AttributeError there."""
    assert [p.id for p in checks.check_api_settings()] == []  # the API is routed in the test settings
    del settings.ROOT_URLCONF
    assert checks.check_api_settings() == []


#: A PostgreSQL server without pgvector (the tests' own server has it): Debian's plain packages.
PLAIN_POSTGRES_URL = os.environ.get("AFKMEMORY_TEST_PLAIN_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture
def database_without_pgvector():
    """Yield the URL of a scratch database on a server without pgvector; drop it afterwards."""
    try:
        admin = psycopg.connect(PLAIN_POSTGRES_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        pytest.skip(f"no PostgreSQL without pgvector at {PLAIN_POSTGRES_URL} (AFKMEMORY_TEST_PLAIN_PG_URL): {exc}")
    with admin:
        if admin.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone():
            pytest.skip(f"the PostgreSQL at {PLAIN_POSTGRES_URL} has pgvector; this test needs one without")
        name = f"afkmemory_no_vector_{uuid.uuid4().hex[:12]}"
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield PLAIN_POSTGRES_URL.rsplit("/", 1)[0] + f"/{name}"
        finally:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.mark.django_db(databases=["default", "postgres"])
def test_a_postgresql_server_without_pgvector_is_refused_before_migrate_fails_on_it(
    database_without_pgvector, monkeypatch, settings
):
    """migrate died in afkmemory.0001 on CREATE EXTENSION with a 60-line traceback, and check said nothing."""
    from project.settings import database_from_url

    assert checks.check_pgvector(databases=["default", "postgres"]) == []  # SQLite; a server with pgvector
    plain = ConnectionHandler(
        {"default": settings.DATABASES["default"], "plain": database_from_url(database_without_pgvector)}
    )
    monkeypatch.setattr(checks, "connections", plain)
    try:
        [problem] = checks.check_pgvector(databases=["default", "plain"])
    finally:
        plain.close_all()
    assert problem.id == "afkmemory.E010" and "'plain'" in problem.msg
    with psycopg.connect(database_without_pgvector) as connection:
        major = connection.info.server_version // 10000
    assert f"postgresql-{major}-pgvector" in problem.hint and "superuser" in problem.hint


@pytest.mark.django_db(databases=["default", "postgres"])  # the handler's aliases are checked by name
def test_a_role_that_may_not_create_pgvector_is_pointed_out_before_migrate_starts(monkeypatch, settings):
    """As a role that is no superuser, on a database without the extension, migrate applied
    Django's own migrations, then stopped on CREATE EXTENSION vector; check said nothing. A
    warning, not an error: a managed service's administrator role (rds_superuser) may create it."""
    from tests.pg import postgres_url

    name, role = f"afkmemory_plain_{uuid.uuid4().hex[:12]}", "afkmemory_plain_role"
    with psycopg.connect(postgres_url(), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        admin.execute(f"DROP ROLE IF EXISTS {role}")
        admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER")
        try:
            plain = {**settings.DATABASES["postgres"], "NAME": name, "TEST": {}}
            handler = ConnectionHandler({"default": plain, "plain": {**plain, "USER": role}})
            monkeypatch.setattr(checks, "connections", handler)
            try:
                [problem] = checks.check_pgvector(databases=["plain"])
                assert checks.check_pgvector(databases=["default"]) == []  # a superuser: migrate creates it
            finally:
                handler.close_all()
        finally:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
            admin.execute(f"DROP ROLE {role}")
    assert problem.id == "afkmemory.W009" and "'plain'" in problem.msg and "superuser" in problem.msg
    assert "CREATE EXTENSION vector" in problem.hint and "rds_superuser" in problem.hint
    assert checks.pgvector_problem("db", "0.8.1", "0.8.1", 18, creatable=False) is None  # created already


def test_a_pgvector_without_hnsw_indexes_is_refused_too():
    """pgvector before 0.5 has no HNSW index: the first migration would fail on it just the same."""
    assert checks.pgvector_problem("db", None, "0.8.1", 18) is None  # migrate creates it
    assert checks.pgvector_problem("db", "0.5.0", "0.5.0", 16) is None
    created = checks.pgvector_problem("db", "0.4.4", "0.8.1", 16)
    assert created is not None and created.id == "afkmemory.E010" and "pgvector 0.4.4" in created.msg
    assert "ALTER EXTENSION vector UPDATE" in created.hint
    available = checks.pgvector_problem("db", None, "0.4.1", 15)
    assert available is not None and "pgvector 0.4.1" in available.msg
    assert "postgresql-15-pgvector" in available.hint and "ALTER" not in available.hint


@pytest.mark.slow
def test_migrate_on_a_server_without_pgvector_stops_at_the_check(database_without_pgvector):
    """The check runs as migrate's own (Tags.database), before any table is made."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "REDIS_URL", "AFK"))}
    env.update(DJANGO_SETTINGS_MODULE="project.settings", DATABASE_URL=database_without_pgvector, CONN_MAX_AGE="0")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "manage.py", "migrate"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "afkmemory.E010" in done.stderr and "Traceback" not in done.stderr
    with psycopg.connect(database_without_pgvector) as connection:
        assert connection.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone() == (0,)


@pytest.mark.django_db(databases=["postgres"], transaction=True)
def test_clearing_owned_memories_mismatched_embeddings_rebuilds_in_one_transaction(django_user_model):
    """The clear and the rebuild's rewrite updated each row twice in one transaction, which queued
    the owner key's deferred check, and PostgreSQL refused the CREATE INDEX: every memory written
    through the API has an owner, so the rebuild always failed (helper-102)."""
    user = django_user_model.objects.db_manager("postgres").create_user("owner")
    store = SyncDjangoMemoryStore(owner=user, using="postgres")
    store.upsert_long_term_memory(LongTermMemory("old", "u", text="kept"), embedding=[1.0] * DIMENSIONS)
    out = StringIO()
    try:
        with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": 16}):
            call_command("afkmemory_rebuild_indexes", database="postgres", clear_mismatched_embeddings=True, stdout=out)
            assert "Cleared 1 mismatched embeddings" in out.getvalue()
            with connections["postgres"].cursor() as cursor:
                cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = %s", [indexes.HNSW_INDEX])
                assert "vector(16)" in cursor.fetchone()[0]
            assert [m.id for m in store.search_long_term_memory_text("u", "kept")] == ["old"]
    finally:  # the index back at the suite's dimension
        call_command("afkmemory_rebuild_indexes", database="postgres", stdout=StringIO())


@pytest.mark.django_db(databases=["postgres"])
@pytest.mark.parametrize("concurrently", [False, True])
def test_a_text_search_config_the_server_lacks_is_refused_before_anything_changes(concurrently):
    """A misspelt name passed the checks (a name, not a configuration of the server's); the
    rebuild switched the trigger to it and failed, and from then on every write to memories
    failed in every process, until a rebuild with a valid one (helper-102)."""
    with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": DIMENSIONS, "TEXT_SEARCH_CONFIG": "klingon"}):
        found = checks.check_search_indexes(databases=["postgres"])
        [error] = [problem for problem in found if problem.id == "afkmemory.E012"]
        assert "'klingon'" in error.msg and "english" in error.msg  # the server's configurations
        with pytest.raises(CommandError, match="'klingon'.*nothing was changed"):
            call_command("afkmemory_rebuild_indexes", database="postgres", concurrently=concurrently)
    with connections["postgres"].cursor() as cursor:
        assert indexes.trigger_config(cursor) == "english"
        assert indexes.index_state(cursor, indexes.VECTOR_GIN_INDEX) == "valid"
    SyncDjangoMemoryStore(using="postgres").upsert_long_term_memory(LongTermMemory("m", "u", text="still written"))


class KeepsAfkmemoryOffPostgres:
    def allow_migrate(self, db, app_label, **hints):
        return False if (db, app_label) == ("postgres", "afkmemory") else None


@pytest.mark.django_db(databases=["postgres"])
def test_a_database_the_routers_keep_afkmemory_out_of_is_not_checked_for_its_indexes():
    """Django records afkmemory's migrations as applied there too, with no table: the indexes
    were 'missing', and a configuration made only in afkmemory's database refused its migrate."""
    with connections["postgres"].cursor() as cursor:
        cursor.execute(f"DROP INDEX {indexes.HNSW_INDEX}")  # rolled back with the test's transaction
    assert [p.id for p in checks.check_search_indexes(databases=["postgres"])] == ["afkmemory.W002"]
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.KeepsAfkmemoryOffPostgres"]):
        assert checks.check_search_indexes(databases=["postgres"]) == []
        with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": DIMENSIONS, "TEXT_SEARCH_CONFIG": "klingon"}):
            assert checks.check_search_indexes(databases=["postgres"]) == []


@pytest.mark.django_db(databases=["postgres"])
def test_a_check_whose_query_fails_leaves_the_callers_transaction_usable(monkeypatch):
    """A role that may not read django_migrations (or a catalog): the check goes on without that
    database, and left a caller's transaction (a test's) aborted for every statement after it."""

    def refused(cursor, name):
        cursor.execute("SELECT 1 / 0")

    monkeypatch.setattr(indexes, "index_state", refused)
    assert checks.check_search_indexes(databases=["postgres"]) == []
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)


@pytest.mark.django_db(databases=["postgres"], transaction=True)
def test_a_check_whose_query_fails_leaves_a_transaction_without_atomic_usable(monkeypatch):
    """Autocommit turned off by hand, not by atomic(): the savepoint was taken only in atomic blocks."""
    from django.db import transaction

    def refused(cursor, name):
        cursor.execute("SELECT 1 / 0")

    monkeypatch.setattr(indexes, "index_state", refused)
    transaction.set_autocommit(False, using="postgres")
    try:
        assert checks.check_search_indexes(databases=["postgres"]) == []
        with connections["postgres"].cursor() as cursor:
            cursor.execute("SELECT 1")
            assert cursor.fetchone() == (1,)
    finally:
        transaction.rollback(using="postgres")
        transaction.set_autocommit(True, using="postgres")


@pytest.mark.django_db(databases=["postgres"])
@pytest.mark.parametrize(("index", "check_id"), [(indexes.HNSW_INDEX, "afkmemory.W002"),
                                                 (indexes.VECTOR_GIN_INDEX, "afkmemory.W007")])  # fmt: skip
def test_a_missing_search_index_is_pointed_out(index, check_id):
    """W002 warned of an HNSW index built for another dimension, not of one dropped (or left
    invalid by an interrupted concurrent build), under which search works, reading every row."""
    assert checks.check_search_indexes(databases=["postgres"]) == []
    with connections["postgres"].cursor() as cursor:
        cursor.execute(f"DROP INDEX {index}")  # rolled back with the test's transaction
    [problem] = checks.check_search_indexes(databases=["postgres"])
    assert problem.id == check_id and index in problem.msg and "missing" in problem.msg


@pytest.mark.django_db(databases=["postgres"])
def test_stored_text_search_vectors_in_another_configuration_are_pointed_out():
    assert checks.check_search_indexes(databases=["postgres"]) == []
    with override_settings(AFKMEMORY={"EMBEDDING_DIMENSIONS": DIMENSIONS, "TEXT_SEARCH_CONFIG": "simple"}):
        [problem] = checks.check_search_indexes(databases=["postgres"])
        assert problem.id == "afkmemory.W007" and "'english'" in problem.msg and "'simple'" in problem.msg
        with connections["postgres"].cursor() as cursor:
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # before DDL, as a commit would
        call_command("afkmemory_rebuild_indexes", database="postgres", stdout=StringIO())
        assert checks.check_search_indexes(databases=["postgres"]) == []
