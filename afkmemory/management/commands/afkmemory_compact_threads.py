"""Compact every thread over its budgets: events, old runs' checkpoints, old graph checkpoints (cron-usable)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from afkmemory import maintenance
from afkmemory.maintenance import counted
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
        removed = [counted(summary.events_removed, "event")]
        if summary.state_keys_removed:
            keys = summary.state_keys_removed
            removed.append(f"{keys} checkpoint{' or effect' if keys == 1 else 's and effects'} of old runs")
        if summary.graph_checkpoints_removed:
            removed.append(counted(summary.graph_checkpoints_removed, "old graph checkpoint"))
        listed = ", ".join(removed[:-1]) + f" and {removed[-1]}" if len(removed) > 1 else removed[0]
        done = f"Compacted {counted(summary.threads, 'thread')}, removed {listed}"
        if summary.failed:  # a failing exit status, for cron and monitoring
            raise CommandError(f"{done}; {summary.failed} failed (see the log).")
        if verbosity:  # -v 0, for cron: nothing unless it fails
            self.stdout.write(self.style.SUCCESS(f"{done}."))
