"""Rebuild the search indexes (and PostgreSQL's stored text search vectors) after EMBEDDING_DIMENSIONS or
TEXT_SEARCH_CONFIG changed."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connections, transaction

from afkmemory import indexes
from afkmemory.management import add_database_argument


class Command(BaseCommand):
    help = "Drop and recreate afkmemory's search indexes from the current AFKMEMORY settings."

    def add_arguments(self, parser: CommandParser) -> None:
        add_database_argument(parser)
        parser.add_argument(
            "--clear-mismatched-embeddings",
            action="store_true",
            help="Set embeddings whose length is not EMBEDDING_DIMENSIONS to NULL "
            "(search ignores them anyway; re-embed those memories afterwards).",
        )

    def handle(self, *args: Any, database: str, clear_mismatched_embeddings: bool, **options: Any) -> None:
        connection = connections[database]
        dims = indexes.embedding_dimensions()
        with transaction.atomic(using=database), connection.cursor() as cursor:
            # float32 components: pgvector counts dimensions, SQLite stores 4 bytes each.
            length, expected = (
                ("vector_dims(embedding)", dims)
                if connection.vendor == "postgresql"
                else ("length(embedding)", dims * 4)
            )
            mismatch = f"FROM {indexes.MEMORY_TABLE} WHERE embedding IS NOT NULL AND {length} <> %s"
            cursor.execute(f"SELECT count(*) {mismatch}", [expected])
            mismatched = cursor.fetchone()[0]
            if mismatched and not clear_mismatched_embeddings:
                self.stdout.write(
                    self.style.WARNING(
                        f"{mismatched} memories have embeddings that are not {dims}-dimensional: vector search "
                        "ignores them until they are re-embedded (--clear-mismatched-embeddings sets them to NULL)."
                    )
                )
            elif mismatched:
                cursor.execute(
                    f"UPDATE {indexes.MEMORY_TABLE} SET embedding = NULL WHERE id IN (SELECT id {mismatch})", [expected]
                )
                self.stdout.write(f"Cleared {mismatched} mismatched embeddings.")
            if connection.vendor == "postgresql":
                indexes.rebuild_postgresql(cursor)
            else:
                for sql in indexes.drop_statements(connection.vendor) + indexes.create_statements(connection.vendor):
                    cursor.execute(sql)
        indexes.forget_search_vectors(database)
        self.stdout.write(self.style.SUCCESS(f"Rebuilt the search indexes of {database!r} ({connection.vendor})."))
