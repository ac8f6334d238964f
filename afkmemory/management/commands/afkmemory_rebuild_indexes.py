"""Rebuild the search indexes (and PostgreSQL's stored text search vectors) after EMBEDDING_DIMENSIONS or
TEXT_SEARCH_CONFIG changed."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections, transaction

from afkmemory import indexes
from afkmemory.management import add_database_argument

#: The advisory lock key one rebuild holds on a PostgreSQL database while it runs.
REBUILD_LOCK = 0x61666B7262  # "afkrb"


class Command(BaseCommand):
    help = (
        "Drop and recreate afkmemory's search indexes from the current AFKMEMORY settings "
        "(--concurrently: online, on PostgreSQL)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_database_argument(parser)
        parser.add_argument(
            "--clear-mismatched-embeddings",
            action="store_true",
            help="Set embeddings whose length is not EMBEDDING_DIMENSIONS to NULL "
            "(search ignores them anyway; re-embed those memories afterwards).",
        )
        parser.add_argument(
            "--concurrently",
            action="store_true",
            help="PostgreSQL only: rebuild online, without locking the memory table (CREATE INDEX CONCURRENTLY, "
            "the stored text search vectors rewritten in batches); search stays correct, slower meanwhile. "
            "Safe to run again after it was interrupted.",
        )

    def handle(
        self, *args: Any, database: str, clear_mismatched_embeddings: bool, concurrently: bool = False, **options: Any
    ) -> None:
        connection = connections[database]
        if connection.vendor == "postgresql":  # before anything is dropped or switched to it
            with connection.cursor() as cursor:
                unknown = indexes.unknown_text_search_config(cursor)
            if unknown:
                raise CommandError(f"{unknown}: nothing was changed.")
        if concurrently:
            self.rebuild_concurrently(database, clear_mismatched_embeddings)
            return
        with transaction.atomic(using=database), connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                self.claim(cursor, "pg_try_advisory_xact_lock")  # released with the transaction
            mismatched = self.count_mismatched(connection, cursor)
            if mismatched and not clear_mismatched_embeddings:
                self.warn_mismatched(mismatched)
            elif mismatched:
                mismatch = indexes.mismatched_embedding_sql(connection.vendor)
                cursor.execute(f"UPDATE {indexes.MEMORY_TABLE} SET embedding = NULL WHERE {mismatch}")
                self.stdout.write(f"Cleared {mismatched} mismatched embeddings.")
                if connection.vendor == "postgresql":
                    # The rebuild's rewrite of these rows updates them a second time in this
                    # transaction, which queues the owner key's deferred check, and PostgreSQL
                    # refuses CREATE INDEX on a table with checks pending: run them as they come.
                    cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
            if connection.vendor == "postgresql":
                indexes.rebuild_postgresql(cursor)
            else:
                for sql in indexes.drop_statements(connection.vendor) + indexes.create_statements(connection.vendor):
                    cursor.execute(sql)
        indexes.forget_search_vectors(database)
        self.stdout.write(self.style.SUCCESS(f"Rebuilt the search indexes of {database!r} ({connection.vendor})."))

    def rebuild_concurrently(self, database: str, clear_mismatched_embeddings: bool) -> None:
        """``--concurrently``: ``indexes.rebuild_postgresql_concurrently``, the embeddings cleared in batches first."""
        connection = connections[database]
        if connection.vendor != "postgresql":
            raise CommandError(
                f"--concurrently is PostgreSQL only; database {database!r} is {connection.vendor}: "
                "run afkmemory_rebuild_indexes without it."
            )
        if connection.in_atomic_block:
            raise CommandError("--concurrently cannot run inside a transaction (CREATE INDEX CONCURRENTLY).")
        with connection.cursor() as cursor:
            self.claim(cursor, "pg_try_advisory_lock")  # the session's: released below, or as the process dies
            mismatched = self.count_mismatched(connection, cursor)
        try:
            if mismatched and not clear_mismatched_embeddings:
                self.warn_mismatched(mismatched)
            elif mismatched:
                cleared = indexes.clear_mismatched_embeddings(connection)
                self.stdout.write(f"Cleared {cleared} mismatched embeddings.")
            indexes.rebuild_postgresql_concurrently(connection, self.stdout.write)
        finally:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [REBUILD_LOCK])
        self.stdout.write(self.style.SUCCESS(f"Rebuilt the search indexes of {database!r} (postgresql) concurrently."))

    @staticmethod
    def claim(cursor: Any, function: str) -> None:
        """Take the rebuild's advisory lock, or refuse: two rebuilds at once deadlocked, or
        collided replacing the trigger, and one died with PostgreSQL's error."""
        cursor.execute(f"SELECT {function}(%s)", [REBUILD_LOCK])
        if not cursor.fetchone()[0]:
            raise CommandError(
                "another afkmemory_rebuild_indexes is running on this database: let it finish, "
                "then run this one again if the settings changed since it started."
            )

    @staticmethod
    def count_mismatched(connection: Any, cursor: Any) -> int:
        mismatch = indexes.mismatched_embedding_sql(connection.vendor)
        cursor.execute(f"SELECT count(*) FROM {indexes.MEMORY_TABLE} WHERE {mismatch}")
        return int(cursor.fetchone()[0])

    def warn_mismatched(self, mismatched: int) -> None:
        dims = indexes.embedding_dimensions()
        self.stdout.write(
            self.style.WARNING(
                f"{mismatched} memories have embeddings that are not {dims}-dimensional: vector search "
                "ignores them until they are re-embedded (--clear-mismatched-embeddings sets them to NULL)."
            )
        )
