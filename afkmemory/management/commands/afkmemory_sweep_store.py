"""Delete expired store items in bounded batches (run it from cron, like ``clearsessions``)."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from afkmemory import maintenance
from afkmemory.conf import MAX_DELETE_BATCH_SIZE, afk_settings
from afkmemory.maintenance import counted
from afkmemory.management import add_database_argument


def batch_size(text: str) -> int:
    """A ``--batch-size``: what ``DELETE_BATCH_SIZE`` may be."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_DELETE_BATCH_SIZE:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {MAX_DELETE_BATCH_SIZE}, got {text!r}")
    return value


class Command(BaseCommand):
    help = (
        "Delete expired items of the cross-thread store, every owner's, in batches of --batch-size, "
        "each its own short transaction. Reads already skip expired items; this reclaims their space."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_database_argument(parser)
        parser.add_argument(
            "--batch-size",
            type=batch_size,
            default=None,
            help=f"Rows per DELETE (default: AFKMEMORY['DELETE_BATCH_SIZE'], now {afk_settings.DELETE_BATCH_SIZE}).",
        )

    def handle(self, *args: Any, database: str, batch_size: int | None, verbosity: int, **options: Any) -> None:
        try:
            # The same single-flight job beat runs, so cron beside beat sweeps once.
            deleted = maintenance.sweep_store(using=database, batch_size=batch_size)
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        if verbosity == 0:  # cron: say nothing unless it fails
            return
        if deleted is None:
            self.stdout.write("Another sweep holds the claim; nothing done.")
            return
        self.stdout.write(f"Deleted {counted(deleted, 'expired store item')} from {database!r}.")
