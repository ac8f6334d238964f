"""Migrating a database that holds data: upgrading through 0004, and unmigrating the app.

Run in a child process on a fresh SQLite file and a fresh PostgreSQL database, as
``manage.py migrate`` would on a user's. Upgrading: migrate to 0002, write a memory, migrate
to 0003 (which drops the foreign keys' own indexes), write memories (one with the search
text the code before 0004 wrote), migrate to the latest (0004 rewrites it as words), then
back to 0002 and forward again. The memory must stay findable by text (on SQLite the full-text index is kept in step
by triggers, which rebuilding a table would drop) and the indexes must go and come back.
Unmigrating: ``migrate afkmemory zero`` removes the app's tables and leaves pgvector's
extension, which the project may use, installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from tests.pg import postgres_url

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

CHILD = r"""
import json
import django
django.setup()
from django.core.management import call_command
from django.db import connection
from afkmemory import models
from afkmemory.memory import LongTermMemory
from afkmemory.stores import SyncDjangoMemoryStore

FOREIGN_KEYS = [(models.Event, "thread_id"), (models.StateEntry, "thread_id"), (models.Checkpoint, "thread_id"),
                (models.Effect, "thread_id"), (models.GraphCheckpoint, "thread_id"),
                (models.LongTermMemory, "owner_id"), (models.Thread, "owner_id")]

def own_indexes():
    with connection.cursor() as cursor:
        found = {}
        for model, column in FOREIGN_KEYS:
            constraints = connection.introspection.get_constraints(cursor, model._meta.db_table)
            found[model.__name__] = sorted(
                name for name, info in constraints.items()
                if info["index"] and not info["unique"] and info["columns"] == [column]
            )
        return found

def found(text):
    return [m.id for m in SyncDjangoMemoryStore().search_long_term_memory_text("u1", text)]

report = {}
call_command("migrate", "afkmemory", "0002", verbosity=0)
report["at_0002"] = own_indexes()
store = SyncDjangoMemoryStore()
store.upsert_long_term_memory(LongTermMemory("before", "u1", text="prefers window seats"))
call_command("migrate", "afkmemory", "0003", verbosity=0)
report["at_0003"] = own_indexes()
store.upsert_long_term_memory(LongTermMemory("after", "u1", text="prefers aisle seats"))
report["search_0003"] = [found("window"), found("aisle")]
# search_text as the code before 0004 wrote it: the raw text (PostgreSQL's parser keeps the address whole)
store.upsert_long_term_memory(LongTermMemory("mail", "u1", text="write to alice@example.com"))
models.LongTermMemory.objects.filter(memory_id="mail").update(search_text="write to alice@example.com")
call_command("migrate", "afkmemory", verbosity=0)
report["search_0004"] = [found("alice"), found("example"), found("window")]
call_command("migrate", "afkmemory", "0002", verbosity=0)
report["back_at_0002"] = own_indexes()
call_command("migrate", "afkmemory", verbosity=0)
report["again_at_0003"] = own_indexes()
report["search_again"] = [found("window"), found("aisle"), found("seats")]
print(json.dumps(report))
"""

UNMIGRATE_CHILD = r"""
import json, sys
import django
django.setup()
from django.core.management import call_command
from django.db import connection
from afkmemory.memory import LongTermMemory
from afkmemory.stores import SyncDjangoMemoryStore

with connection.cursor() as cursor:
    for sql in filter(None, sys.argv[1].split(";")):  # what the project had before installing the app
        cursor.execute(sql)
call_command("migrate", verbosity=0)
store = SyncDjangoMemoryStore()
store.upsert_long_term_memory(LongTermMemory("m", "u1", text="window seats"))
call_command("migrate", "afkmemory", "zero", verbosity=0)
report = {}
with connection.cursor() as cursor:
    report["tables_at_zero"] = connection.introspection.table_names(cursor)
    if connection.vendor == "postgresql":
        cursor.execute("SELECT extname FROM pg_extension WHERE extname = 'vector'")
        report["extensions_at_zero"] = [row[0] for row in cursor.fetchall()]
call_command("migrate", "afkmemory", verbosity=0)
store.upsert_long_term_memory(LongTermMemory("m", "u1", text="window seats"))
report["found_again"] = [m.id for m in store.search_long_term_memory_text("u1", "window")]
print(json.dumps(report))
"""


#: Run first in every child: each process rechecks the schema of the stored text search vectors
#: every second instead of every 10 (``indexes.SEARCH_VECTORS_TTL``), and 0009 backwards
#: waits that second, not 10, for processes to notice (the same logic, sooner).
QUICK_SCHEMA_CHECKS = "import django\ndjango.setup()\nfrom afkmemory import indexes\nindexes.SEARCH_VECTORS_TTL = 1.0\n"


def _migrate_in_child(database_url: str, tmp_path: Path, script: str = CHILD, project_sql: str = "") -> dict:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DATABASE_URL": database_url,
        "AFKMEMORY_VAR_DIR": str(tmp_path / "var"),
        "AFKMEMORY_EMBEDDING_DIMENSIONS": "8",
        "REDIS_URL": "",
    }
    done = subprocess.run(
        [sys.executable, "-c", QUICK_SCHEMA_CHECKS + script, project_sql],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check(report: dict) -> None:
    assert all(report["at_0002"].values()), report["at_0002"]  # each foreign key had its own index
    assert not any(report["at_0003"].values()), report["at_0003"]
    assert all(report["back_at_0002"].values()), report["back_at_0002"]
    assert not any(report["again_at_0003"].values()), report["again_at_0003"]
    assert report["search_0003"] == [["before"], ["after"]]
    assert report["search_0004"] == [["mail"], ["mail"], ["before"]]  # 0004 rewrote search_text as words
    assert report["search_again"][:2] == [["before"], ["after"]]
    assert sorted(report["search_again"][2]) == ["after", "before"]


def test_upgrading_sqlite_keeps_text_search(tmp_path):
    _check(_migrate_in_child(f"sqlite:///{tmp_path / 'db.sqlite3'}", tmp_path))


@contextmanager
def _fresh_postgresql_database() -> Iterator[str]:
    """Yield the URL of a new, empty PostgreSQL database, dropped afterwards."""
    admin_url = postgres_url()
    dbname = f"afkmemory_migrations_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    try:
        yield urlunsplit(urlsplit(admin_url)._replace(path="/" + dbname))
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def test_upgrading_postgresql(tmp_path):
    with _fresh_postgresql_database() as url:
        _check(_migrate_in_child(url, tmp_path))


def test_unmigrating_sqlite_removes_the_tables(tmp_path):
    """``migrate afkmemory zero`` on SQLite reverses every migration, and the app migrates again."""
    report = _migrate_in_child(f"sqlite:///{tmp_path / 'db.sqlite3'}", tmp_path, UNMIGRATE_CHILD)
    assert [t for t in report["tables_at_zero"] if t.startswith("afkmemory_")] == []
    assert report["found_again"] == ["m"]


def test_unmigrating_postgresql_keeps_the_vector_extension_the_project_uses(tmp_path):
    """``migrate afkmemory zero`` on PostgreSQL leaves the vector extension and the project's vector table."""
    project = "CREATE EXTENSION IF NOT EXISTS vector;CREATE TABLE project_document (id bigint PRIMARY KEY, v vector(3))"
    with _fresh_postgresql_database() as url:
        report = _migrate_in_child(url, tmp_path, UNMIGRATE_CHILD, project)
    assert [t for t in report["tables_at_zero"] if t.startswith("afkmemory_")] == []
    assert "project_document" in report["tables_at_zero"]
    assert report["extensions_at_zero"] == ["vector"]
    assert report["found_again"] == ["m"]


INTERRUPTED_INDEX_CHILD = r"""
import json, sys
import django
django.setup()
from django.core.management import call_command
from django.db import connection
from afkmemory import indexes

INDEX, COLUMNS, BEFORE = json.loads(sys.argv[1])

def state():
    with connection.cursor() as cursor:
        return indexes.index_state(cursor, INDEX)

report = {}
call_command("migrate", verbosity=0)
report["migrated"] = state()
call_command("migrate", "afkmemory", BEFORE, verbosity=0)
report["backwards"] = state()
# The migrate process killed after sending CREATE INDEX CONCURRENTLY: the server finished it.
with connection.cursor() as cursor:
    cursor.execute(f"CREATE INDEX {INDEX} ON {COLUMNS}")
call_command("migrate", "afkmemory", verbosity=0)
report["after_killed_client"] = state()
# The build interrupted on the server: an invalid index is left behind.
call_command("migrate", "afkmemory", BEFORE, verbosity=0)
with connection.cursor() as cursor:
    cursor.execute(f"CREATE INDEX {INDEX} ON {COLUMNS}")
    cursor.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = to_regclass(%s)", [INDEX])
report["left_behind"] = state()
call_command("migrate", "afkmemory", verbosity=0)
report["after_interrupted_build"] = state()
print(json.dumps(report))
"""

#: Each index a migration builds CONCURRENTLY: its name, its definition, the migration before it.
CONCURRENT_INDEXES = {
    "0006": [
        "afkmemory_memory_owner_recent",
        'afkmemory_longtermmemory ("owner_id", "updated_at" DESC, "memory_id")',
        "0005",
    ],
    "0010": [
        "afkmemory_memory_user_recent",
        'afkmemory_longtermmemory ("owner_id", "user_id", "updated_at" DESC, "memory_id")',
        "0009",
    ],
    "0011": ["afkmemory_memory_tags", "afkmemory_longtermmemory USING gin (tags jsonb_path_ops)", "0010"],
}


@pytest.mark.parametrize("migration", list(CONCURRENT_INDEXES))
def test_an_interrupted_concurrent_index_build_does_not_stop_the_next_migrate(tmp_path, migration):
    """0006, 0010 and 0011 build their index CONCURRENTLY, outside a transaction, and drop it backwards.
    A migrate killed after sending the build left the index built but 0006 unrecorded: every
    later migrate failed with 'relation "afkmemory_memory_owner_recent" already exists' (found
    by an upgrade review)."""
    with _fresh_postgresql_database() as url:
        report = _migrate_in_child(url, tmp_path, INTERRUPTED_INDEX_CHILD, json.dumps(CONCURRENT_INDEXES[migration]))
    assert report == {
        "migrated": "valid",
        "backwards": None,
        "after_killed_client": "valid",
        "left_behind": "invalid",
        "after_interrupted_build": "valid",
    }


def test_the_user_index_migrates_both_ways_on_sqlite(tmp_path):
    """0010 is a plain CREATE INDEX on SQLite, and a DROP INDEX backwards."""
    script = r"""
import json
import django
django.setup()
from django.core.management import call_command
from django.db import connection

def names():
    with connection.cursor() as cursor:
        return sorted(connection.introspection.get_constraints(cursor, "afkmemory_longtermmemory"))

call_command("migrate", verbosity=0)
report = {"latest": names()}
call_command("migrate", "afkmemory", "0009", verbosity=0)
report["at_0009"] = names()
print(json.dumps(report))
"""
    report = _migrate_in_child(f"sqlite:///{tmp_path / 'db.sqlite3'}", tmp_path, script)
    assert "afkmemory_memory_user_recent" in report["latest"]
    assert sorted(set(report["latest"]) - set(report["at_0009"])) == ["afkmemory_memory_user_recent"]


def test_the_tags_index_changes_nothing_on_sqlite(tmp_path):
    """0011 is PostgreSQL's (a GIN index): on SQLite it migrates both ways and changes no index,
    and the tag filter finds the same memories."""
    script = r"""
import json
import django
django.setup()
from django.core.management import call_command
from django.db import connection
from afkmemory import models
from afkmemory.memory import LongTermMemory
from afkmemory.stores import SyncDjangoMemoryStore

def state():
    with connection.cursor() as cursor:
        names = sorted(connection.introspection.get_constraints(cursor, "afkmemory_longtermmemory"))
    return [names, sorted(models.LongTermMemory.objects.with_tag("tea").values_list("memory_id", flat=True))]

call_command("migrate", "afkmemory", "0010", verbosity=0)
store = SyncDjangoMemoryStore()
store.upsert_long_term_memory(LongTermMemory("m1", "u1", tags=["tea", "x"]))
store.upsert_long_term_memory(LongTermMemory("m2", "u1", tags=["tea-time"]))
report = {"at_0010": state()}
call_command("migrate", "afkmemory", verbosity=0)
report["latest"] = state()
call_command("migrate", "afkmemory", "0010", verbosity=0)
report["back_at_0010"] = state()
print(json.dumps(report))
"""
    report = _migrate_in_child(f"sqlite:///{tmp_path / 'db.sqlite3'}", tmp_path, script)
    assert report["at_0010"][1] == ["m1"]
    assert report["latest"] == report["at_0010"] == report["back_at_0010"], report


SEARCH_VECTOR_CHILD = r"""
import json
import django
django.setup()
from django.core.management import call_command
from django.db import connection
from afkmemory import indexes
from afkmemory.memory import LongTermMemory
from afkmemory.stores import SyncDjangoMemoryStore

def schema():
    with connection.cursor() as cursor:
        column = indexes.has_vector_column(cursor)
        cursor.execute("SELECT count(*) FROM pg_trigger WHERE tgname = %s", [indexes.VECTOR_TRIGGER])
        trigger = cursor.fetchone()[0]
        if column:
            cursor.execute(
                f"SELECT count(*) FROM {indexes.MEMORY_TABLE} "
                "WHERE search_vector IS DISTINCT FROM to_tsvector('english', search_text)"
            )
            out_of_step = cursor.fetchone()[0]
        else:
            out_of_step = None
        return {
            "column": column, "trigger": trigger, "out_of_step": out_of_step,
            "vector_index": indexes.index_state(cursor, indexes.VECTOR_GIN_INDEX),
            "expression_index": indexes.index_state(cursor, indexes.GIN_INDEX),
        }

def found(text):
    indexes.forget_search_vectors()
    store = SyncDjangoMemoryStore()
    return [indexes.stored_vectors("default"), [m.id for m in store.search_long_term_memory_text("u1", text)]]

store = SyncDjangoMemoryStore()
report = {}
call_command("migrate", "afkmemory", "0007", verbosity=0)
report["at_0007"] = schema()
for i in range(7):
    store.upsert_long_term_memory(LongTermMemory(f"m{i}", "u1", text=f"window seat {i}", updated_at=i))
call_command("migrate", "afkmemory", verbosity=0)
report["latest"] = schema()
report["search_latest"] = found("window")
store.upsert_long_term_memory(LongTermMemory("m7", "u1", text="aisle seat", updated_at=7))
call_command("migrate", "afkmemory", "0008", verbosity=0)
report["back_at_0008"] = schema()
report["search_0008"] = found("seat")
call_command("migrate", "afkmemory", "0007", verbosity=0)
report["back_at_0007"] = schema()
report["search_0007"] = found("aisle")
store.upsert_long_term_memory(LongTermMemory("m8", "u1", text="window again", updated_at=8))
# The migrate process killed after sending 0009's build: the server finished it (valid);
# and the build interrupted on the server (invalid): the next migrate goes on either way.
call_command("migrate", "afkmemory", "0008", verbosity=0)
with connection.cursor() as cursor:
    cursor.execute(f"CREATE INDEX {indexes.VECTOR_GIN_INDEX} ON {indexes.vector_index_definition()}")
call_command("migrate", "afkmemory", verbosity=0)
report["after_killed_client"] = schema()
call_command("migrate", "afkmemory", "0008", verbosity=0)
with connection.cursor() as cursor:
    cursor.execute(f"CREATE INDEX {indexes.VECTOR_GIN_INDEX} ON {indexes.vector_index_definition()}")
    cursor.execute(
        "UPDATE pg_index SET indisvalid = false WHERE indexrelid = to_regclass(%s)", [indexes.VECTOR_GIN_INDEX]
    )
call_command("migrate", "afkmemory", verbosity=0)
report["after_interrupted_build"] = schema()
report["search_again"] = found("window")
print(json.dumps(report))
"""


def test_the_stored_search_vector_migrates_forward_and_backward_on_postgresql(tmp_path):
    """0008 adds the vector column and its trigger and fills it for the memories already there,
    0009 indexes it and drops the expression index; backwards each undoes its part, and search
    finds every memory in every state (stored vectors only once their index is valid)."""
    with _fresh_postgresql_database() as url:
        report = _migrate_in_child(url, tmp_path, SEARCH_VECTOR_CHILD)
    old = {"column": False, "trigger": 0, "out_of_step": None, "vector_index": None, "expression_index": "valid"}
    new = {"column": True, "trigger": 1, "out_of_step": 0, "vector_index": "valid", "expression_index": None}
    assert report["at_0007"] == old
    assert report["latest"] == new
    assert report["search_latest"] == [True, [f"m{i}" for i in reversed(range(7))]]
    assert report["back_at_0008"] == {**new, "vector_index": None, "expression_index": "valid"}
    assert report["search_0008"] == [False, [f"m{i}" for i in reversed(range(8))]]
    assert report["back_at_0007"] == old
    assert report["search_0007"] == [False, ["m7"]]
    assert report["after_killed_client"] == new
    assert report["after_interrupted_build"] == new
    assert report["search_again"] == [True, ["m8", *(f"m{i}" for i in reversed(range(7)))]]


def test_the_stored_search_vector_changes_nothing_on_sqlite(tmp_path):
    """0008 and 0009 are PostgreSQL's: on SQLite they migrate both ways and leave the FTS5 search as it was."""
    script = r"""
import json
import django
django.setup()
from django.core.management import call_command
from django.db import connection
from afkmemory.memory import LongTermMemory
from afkmemory.stores import SyncDjangoMemoryStore

call_command("migrate", "afkmemory", "0007", verbosity=0)
store = SyncDjangoMemoryStore()
store.upsert_long_term_memory(LongTermMemory("m", "u1", text="window seats"))
call_command("migrate", "afkmemory", verbosity=0)
with connection.cursor() as cursor:
    columns = [c.name for c in connection.introspection.get_table_description(cursor, "afkmemory_longtermmemory")]
report = {"columns": columns, "found": [m.id for m in store.search_long_term_memory_text("u1", "window")]}
call_command("migrate", "afkmemory", "0007", verbosity=0)
report["found_back"] = [m.id for m in store.search_long_term_memory_text("u1", "seat")]
print(json.dumps(report))
"""
    report = _migrate_in_child(f"sqlite:///{tmp_path / 'db.sqlite3'}", tmp_path, script)
    assert "search_vector" not in report["columns"]
    assert report["found"] == ["m"] and report["found_back"] == ["m"]


WEB_PROCESS = r"""
import json, sys, time
import django
django.setup()
from afkmemory import indexes
from afkmemory.stores import SyncDjangoMemoryStore
store = SyncDjangoMemoryStore()
assert [m.id for m in store.search_long_term_memory_text("u1", "window")]  # the catalog read: stored vectors
print("ready", indexes.stored_vectors("default"), flush=True)
errors, searches, deadline = [], 0, time.monotonic() + 6
while time.monotonic() < deadline:
    try:
        store.search_long_term_memory_text("u1", "window")
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
    searches += 1
    time.sleep(0.05)
print(json.dumps({"searches": searches, "errors": sorted(set(errors)), "failed": len(errors)}), flush=True)
"""

MIGRATE_BACK = r"""
import json, sys, time
import django
django.setup()
from django.core.management import call_command
from afkmemory.memory import LongTermMemory
from afkmemory.stores import SyncDjangoMemoryStore
if sys.argv[1] == "setup":
    call_command("migrate", verbosity=0)
    for i in range(50):
        SyncDjangoMemoryStore().upsert_long_term_memory(LongTermMemory(f"m{i}", "u1", text=f"window seat {i}"))
else:
    started = time.monotonic()
    call_command("migrate", "afkmemory", "0007", verbosity=0)
    print(json.dumps({"took": time.monotonic() - started}))
"""


def _child_env(database_url, tmp_path):
    import os

    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DATABASE_URL": database_url,
        "AFKMEMORY_VAR_DIR": str(tmp_path / "var"),
        "AFKMEMORY_EMBEDDING_DIMENSIONS": "8",
        "REDIS_URL": "",
    }


@pytest.mark.slow
def test_unmigrating_the_search_vector_does_not_break_other_processes_searches(tmp_path):
    """``migrate afkmemory 0007`` while another process searches: no search fails. On a table
    of fewer than 10,000 memories 0009 backwards did not wait, 0008 backwards dropped the
    column at once, and the other process, which believes for up to ``SEARCH_VECTORS_TTL``
    that the stored vectors are searchable, failed with "column ... does not exist" (a 500)."""
    with _fresh_postgresql_database() as database_url:
        env = _child_env(database_url, tmp_path)
        run = dict(cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        done = subprocess.run([sys.executable, "-c", QUICK_SCHEMA_CHECKS + MIGRATE_BACK, "setup"], **run)
        assert done.returncode == 0, done.stderr
        web = subprocess.Popen(
            [sys.executable, "-c", QUICK_SCHEMA_CHECKS + WEB_PROCESS],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert web.stdout.readline().split() == ["ready", "True"], web.stderr.read()
            back = subprocess.run([sys.executable, "-c", QUICK_SCHEMA_CHECKS + MIGRATE_BACK, "back"], **run)
            assert back.returncode == 0, back.stderr
            out, err = web.communicate(timeout=60)
        finally:
            web.kill()
    report = json.loads(out.strip().splitlines()[-1])
    report["migrate_back_took_s"] = json.loads(back.stdout.strip().splitlines()[-1])["took"]
    assert report["failed"] == 0, report


KILLED_BACKFILL_THEN_NEW_CONFIG = r"""
import json
import django
django.setup()
from django.conf import settings
from django.core import checks
from django.core.management import call_command
from django.db import connection
from django.test import override_settings
from afkmemory import indexes
from afkmemory.memory import LongTermMemory
from afkmemory.stores import SyncDjangoMemoryStore

store = SyncDjangoMemoryStore()
call_command("migrate", "afkmemory", "0007", verbosity=0)
for i in range(4):
    store.upsert_long_term_memory(LongTermMemory(f"m{i}", "u1", text=f"running late {i}", updated_at=i))

# migrate, killed during 0008's backfill: its first batch (two memories) committed, in 'english'.
original = indexes.backfill_search_vectors
def killed(connection, *args, **kwargs):
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {indexes.MEMORY_TABLE} SET search_vector = to_tsvector('english', search_text) "
            f"WHERE id IN (SELECT id FROM {indexes.MEMORY_TABLE} ORDER BY id LIMIT 2)"
        )
    raise KeyboardInterrupt("migrate killed")
indexes.backfill_search_vectors = killed
try:
    call_command("migrate", "afkmemory", verbosity=0)
except KeyboardInterrupt:
    pass
indexes.backfill_search_vectors = original

# The operator settles on another configuration, then runs migrate again (as the README says
# to do after a killed migrate), and nothing else.
with override_settings(AFKMEMORY={**settings.AFKMEMORY, "TEXT_SEARCH_CONFIG": "simple"}):
    call_command("migrate", "afkmemory", verbosity=0)
    indexes.forget_search_vectors()
    report = {
        "stored_vectors": indexes.stored_vectors("default"),
        "found": sorted(m.id for m in store.search_long_term_memory_text("u1", "running")),
        "warnings": sorted(m.id for m in checks.run_checks(databases=["default"]) if m.id.startswith("afkmemory")),
    }
print(json.dumps(report))
"""


@pytest.mark.slow
def test_a_killed_0008_run_again_under_another_configuration_finds_every_memory(tmp_path):
    """0008 killed during its backfill (a batch committed in 'english'), TEXT_SEARCH_CONFIG then
    set to 'simple' and ``migrate`` run again: every memory is found. The backfill fills only
    empty vectors, and kept the first batch's 'english' ones, which search then trusted; the
    column is now dropped and added again, empty, when its trigger is in another configuration."""
    with _fresh_postgresql_database() as database_url:
        report = _migrate_in_child(database_url, tmp_path, KILLED_BACKFILL_THEN_NEW_CONFIG)
    assert report["found"] == ["m0", "m1", "m2", "m3"] and report["stored_vectors"], report


MARKS_CHILD = r"""
import json
import django
django.setup()
from django.core.management import call_command
from django.db import connection
from afkmemory import indexes, models
from afkmemory.memory import LongTermMemory
from afkmemory.stores import SyncDjangoMemoryStore

OLD = "porter unicode61 remove_diacritics 2"

def found(text):
    return sorted(m.id for m in SyncDjangoMemoryStore().search_long_term_memory_text("u1", text))

def tokenizer():
    if connection.vendor != "sqlite":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT sql FROM sqlite_master WHERE name = %s", [indexes.FTS_TABLE])
        return "M*" in cursor.fetchone()[0]

call_command("migrate", "afkmemory", "0011", verbosity=0)
if connection.vendor == "sqlite":  # the FTS5 table as 0001 made it before 0012 (0001 reads today's tokenizer)
    with connection.cursor() as cursor:
        for sql in [*indexes.drop_statements("sqlite"), *indexes.create_statements("sqlite", tokenizer=OLD)]:
            cursor.execute(sql)
store = SyncDjangoMemoryStore()
store.upsert_long_term_memory(LongTermMemory("hindi", "u1", text="हिन्दी भाषा"))
store.upsert_long_term_memory(LongTermMemory("other", "u1", text="है न दो"))
store.upsert_long_term_memory(LongTermMemory("plain", "u1", text="plain words"))
# The search text as the code before 0012 wrote it: the marks dropped, the words split at them.
models.LongTermMemory.objects.filter(memory_id="hindi").update(search_text="ह न द भ ष")
models.LongTermMemory.objects.filter(memory_id="other").update(search_text="ह न द")
report = {"old_tokenizer": tokenizer(), "at_0011": found("हिन्दी")}
call_command("migrate", "afkmemory", "0012", verbosity=0)
report["at_0012"] = [found("हिन्दी"), found("है"), found("plain"), tokenizer()]
report["search_text"] = dict(models.LongTermMemory.objects.values_list("memory_id", "search_text"))
call_command("migrate", "afkmemory", "0011", verbosity=0)
report["back_at_0011"] = [found("plain"), tokenizer()]
report["search_text_at_0011"] = dict(models.LongTermMemory.objects.values_list("memory_id", "search_text"))
call_command("migrate", "afkmemory", verbosity=0)
report["again"] = [found("हिन्दी"), found("है"), tokenizer()]
print(json.dumps(report))
"""


def _check_marks(report: dict, vendor: str) -> None:
    sqlite = vendor == "sqlite"
    assert report["old_tokenizer"] is (False if sqlite else None)
    # Before 0012 SQLite's tokenizer split the query as the old search text: "है न दो" matched;
    # PostgreSQL finds neither (the search text is split, today's query word whole).
    assert report["at_0011"] == (["hindi", "other"] if sqlite else [])
    assert report["at_0012"] == [["hindi"], ["other"], ["plain"], True if sqlite else None]
    assert report["search_text"] == {"hindi": "हिन्दी भाषा", "other": "है न दो", "plain": "plain words"}
    assert report["back_at_0011"] == [["plain"], False if sqlite else None]
    # The older code's words are put back: it splits its queries so ("हिन्दी" as "ह न द").
    assert report["search_text_at_0011"] == {"hindi": "ह न द भ ष", "other": "ह न द", "plain": "plain words"}
    assert report["again"] == [["hindi"], ["other"], True if sqlite else None]


def test_words_with_marks_migrate_both_ways_on_sqlite(tmp_path):
    """0012 makes SQLite's FTS5 table again with a tokenizer that keeps marks in words, and
    rewrites the search text written before it; backwards it puts the old tokenizer back."""
    _check_marks(_migrate_in_child(f"sqlite:///{tmp_path / 'db.sqlite3'}", tmp_path, MARKS_CHILD), "sqlite")


def test_words_with_marks_migrate_both_ways_on_postgresql(tmp_path):
    with _fresh_postgresql_database() as url:
        _check_marks(_migrate_in_child(url, tmp_path, MARKS_CHILD), "postgresql")
