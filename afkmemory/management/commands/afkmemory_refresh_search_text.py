"""Rewrite the search text of memories written by older code, so text search finds them again."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from afkmemory import indexes, models
from afkmemory.maintenance import counted
from afkmemory.management import add_database_argument


class Command(BaseCommand):
    help = (
        "Recompute each memory's search text and rewrite those that differ, a small batch per "
        "transaction: for memories that processes on an older afkmemory wrote after migration 0004."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_database_argument(parser)

    def handle(self, *args: Any, database: str, verbosity: int, **options: Any) -> None:
        changed = indexes.refresh_search_text(models.LongTermMemory.objects.using(database))
        if verbosity:
            self.stdout.write(f"Rewrote {counted(changed, 'stale search text')} of memories on {database!r}.")
