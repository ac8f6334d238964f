"""Every foreign key leads an index, and no index is only a prefix of another one.

An index whose columns begin another index's (under the same predicate) answers nothing
the longer one does not, and every insert writes it: the single-column indexes Django
gives foreign keys were that, on every thread-scoped table. Read from PostgreSQL's
catalog after the migrations ran, so what is checked is the schema users get.
"""

from __future__ import annotations

import pytest
from django.apps import apps
from django.db import connections, transaction

from afkmemory import models

pytestmark = pytest.mark.django_db(databases=["postgres"])


def _indexes(table: str) -> list[tuple[str, tuple[str, ...], str | None]]:
    """``(name, key columns or expressions, predicate)`` of each index on ``table``."""
    with connections["postgres"].cursor() as cursor:
        cursor.execute(
            """
            SELECT c.relname,
                   array(SELECT pg_get_indexdef(i.indexrelid, k, true) FROM generate_series(1, i.indnkeyatts) k),
                   pg_get_expr(i.indpred, i.indrelid)
            FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
            WHERE i.indrelid = %s::regclass
            """,
            [table],
        )
        return [(name, tuple(columns), predicate) for name, columns, predicate in cursor.fetchall()]


MODELS = list(apps.get_app_config("afkmemory").get_models())


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_foreign_key_leads_an_index(model):
    indexes = _indexes(model._meta.db_table)
    for field in model._meta.concrete_fields:
        if field.is_relation:
            leading = [name for name, columns, _ in indexes if columns[0] == field.column]
            assert leading, f"{model.__name__}.{field.name}: no index begins with {field.column}"


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_no_index_is_a_prefix_of_another(model):
    indexes = _indexes(model._meta.db_table)
    for name, columns, predicate in indexes:
        longer = [
            other
            for other, other_columns, other_predicate in indexes
            if other != name and other_predicate == predicate and other_columns[: len(columns)] == columns
        ]
        assert not longer, f"{name} {columns} only repeats the start of {longer}"


def _plan(sql: str, params: list) -> str:
    with transaction.atomic(using="postgres"), connections["postgres"].cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a small table: ask whether an index *can* serve
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


def test_deleting_an_account_finds_its_threads_and_memories_through_the_owner_constraints():
    """The cascade's ``owner_id IN (...)`` satisfies the partial ``owner IS NOT NULL`` index."""
    assert "afkmemory_thread_owner_uniq" in _plan("SELECT id FROM afkmemory_thread WHERE owner_id IN (%s)", [1])
    memories = _plan("SELECT id FROM afkmemory_longtermmemory WHERE owner_id IN (%s)", [1])
    assert "Index" in memories and "Seq Scan" not in memories, memories


@pytest.mark.parametrize(
    "model", [models.Event, models.StateEntry, models.Checkpoint, models.Effect, models.GraphCheckpoint]
)
def test_deleting_a_thread_finds_its_rows_through_an_index(model):
    plan = _plan(f"DELETE FROM {model._meta.db_table} WHERE thread_id IN (%s)", [1])
    assert "Index" in plan and "Seq Scan" not in plan, plan


#: The checkpoint key's SQL as migration 0007 indexed it (the effect key's differs in its head and last column).
CHECKPOINT_KEY_SQL = (
    """('checkpoint:' || "afkmemory_checkpoint"."run_id" || ':' || CAST("afkmemory_checkpoint"."step" AS TEXT)"""
    """ || ':' || "afkmemory_checkpoint"."phase")"""
)


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize(
    ("alias", "sql"), [("default", CHECKPOINT_KEY_SQL), ("postgres", f'({CHECKPOINT_KEY_SQL} COLLATE "C")')]
)
def test_the_state_key_expression_is_the_one_migration_0007_indexed(alias, sql):
    """Migration 0007 builds its indexes from ``JournalKey``, and migrations compare it by its
    arguments only: a change to its SQL would make no migration, leave existing databases with
    the old index, and their state pages would read and sort every checkpoint. Change it only
    with a migration that rebuilds both indexes, then this."""
    query = models.Checkpoint.objects.using(alias).all().query
    expression = models.Checkpoint.STATE_KEY.resolve_expression(query)
    assert query.get_compiler(alias).compile(expression) == (sql, [])
