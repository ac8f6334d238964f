"""Batch deletes by primary key, one plain statement per batch: compaction's and the sweep's."""

from __future__ import annotations

from collections.abc import Sequence

from django.core.exceptions import EmptyResultSet, FullResultSet
from django.db import connections
from django.db.models import QuerySet
from django.db.models.deletion import Collector

__all__ = ["IDS_PER_QUERY", "DeleteByPk"]

#: Ids a read sends in one ``IN (...)`` list: SQLite caps a statement's parameters.
IDS_PER_QUERY = 500


class DeleteByPk:
    """``queryset.filter(pk__in=ids).delete()``, batch after batch, as one plain ``DELETE`` each.

    When Django can fast-delete the rows (no delete receivers, nothing that refers to
    them), its ORM sends ``DELETE ... WHERE <queryset's filters> AND pk IN (...)``; this
    sends that statement without building a queryset, a ``Collector`` and one placeholder
    per id for every batch. That per-batch Python kept enough objects alive to set off
    full garbage collections of the process, ~100 ms each, between two statements of a
    compaction or a sweep (BENCHMARKS.md). The queryset's WHERE is compiled once; on
    PostgreSQL the ids go as one array parameter. Otherwise (receivers, a join), each
    batch goes the ORM's way, so nothing it would do is skipped.
    """

    def __init__(self, queryset: QuerySet) -> None:
        self.queryset = queryset
        using = queryset.db
        model = queryset.model
        self.sql: str | None = None  # None: the ORM's way
        if not Collector(using=using, origin=queryset).can_fast_delete(queryset) or len(queryset.query.alias_map) > 1:
            return
        connection = connections[using]
        q = connection.ops.quote_name
        try:
            where, params = queryset.query.get_compiler(using).compile(queryset.query.where)
        except FullResultSet:  # no filter
            where, params = "", []
        except EmptyResultSet:  # a filter nothing matches
            where, params = "1 = 0", []
        self.params = list(params)
        self.postgres = connection.vendor == "postgresql"
        pk = q(model._meta.pk.column)
        # Typed, or psycopg sends the smallest integer array that fits the values.
        match = f"{pk} = ANY(%s::{model._meta.pk.rel_db_type(connection)}[])" if self.postgres else f"{pk} IN ("
        self.sql = f"DELETE FROM {q(model._meta.db_table)} WHERE {f'({where}) AND ' if where else ''}{match}"
        self.using = using

    def __call__(self, ids: Sequence[int]) -> int:
        """Delete the rows of the queryset whose primary key is in ``ids``; return how many went."""
        if self.sql is None:
            return self.queryset.filter(pk__in=ids).delete()[0]
        with connections[self.using].cursor() as cursor:
            if self.postgres:
                cursor.execute(self.sql, [*self.params, list(ids)])
            else:
                cursor.execute(self.sql + ", ".join(["%s"] * len(ids)) + ")", [*self.params, *ids])
            return cursor.rowcount
