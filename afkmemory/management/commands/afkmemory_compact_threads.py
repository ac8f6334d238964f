"""Compact every thread over its budgets: events, old runs' checkpoints, old graph checkpoints (cron-usable)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from afkmemory import maintenance
from afkmemory.management import add_database_argument


class Command(BaseCommand):
    help = (
        "Compact every thread over the AFKMEMORY['COMPACTION_POLICY'] budget and prune old checkpoints "
        "(STATE_RETENTION_POLICY, GRAPH_CHECKPOINT_RETENTION); skip if a run is already going."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_database_argument(parser)

    def handle(self, *args: Any, database: str, verbosity: int, **options: Any) -> None:
        summary = maintenance.compact_threads(using=database)
        if summary is None:
            if verbosity:
                self.stdout.write("Another compaction run holds the claim; nothing done.")
            return
        done = summary.describe()
        if summary.failed:  # a failing exit status, for cron and monitoring
            raise CommandError(f"{done}; {summary.failed} failed (see the log).")
        if verbosity:  # -v 0, for cron: nothing unless it fails
            self.stdout.write(self.style.SUCCESS(f"{done}."))
