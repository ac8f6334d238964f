"""Compact every thread holding more events than COMPACTION_POLICY keeps (cron-usable)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import DEFAULT_DB_ALIAS

from afkmemory import maintenance


class Command(BaseCommand):
    help = "Compact every thread over the AFKMEMORY['COMPACTION_POLICY'] budget; skip if a run is already going."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", default=DEFAULT_DB_ALIAS, help="Database alias (default: default).")

    def handle(self, *args: Any, database: str, **options: Any) -> None:
        summary = maintenance.compact_threads(using=database)
        if summary is None:
            self.stdout.write("Another compaction run holds the claim; nothing done.")
            return
        self.stdout.write(
            self.style.SUCCESS(
                f"Compacted {summary.threads} threads, removed {summary.events_removed} events"
                + (f", {summary.failed} failed (see the log)" if summary.failed else "")
                + "."
            )
        )
