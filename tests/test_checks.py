"""System checks and the index rebuild command."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
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
                                                  ({"DELETE_BATCH_SIZE": 0}, "afkmemory.E006"),
                                                  ({"DELETE_BATCH_SIZE": "500"}, "afkmemory.E006"),
                                                  ({"JOB_LEASE_SECONDS": 0.5}, "afkmemory.E006"),
                                                  ({"API_MAX_PAGE_SIZE": True}, "afkmemory.E006"),
                                                  ({"API_MAX_VALUE_BYTES": 0}, "afkmemory.E006"),
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
