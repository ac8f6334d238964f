"""Celery tasks for the scheduled jobs; the project's beat schedule names them."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from celery import shared_task

from . import maintenance


@shared_task(name="afkmemory.sweep_store", ignore_result=True)
def sweep_store(using: str = "default", batch_size: int | None = None) -> int | None:
    """Delete expired store items (single-flight; idempotent, so safe to run twice)."""
    return maintenance.sweep_store(using=using, batch_size=batch_size)


@shared_task(name="afkmemory.compact_threads", ignore_result=True)
def compact_threads(using: str = "default") -> dict[str, Any] | None:
    """Compact every thread over its budgets: events, old runs' checkpoints, graph checkpoints (single-flight).

    Threads that failed fail the task (after the others were compacted), so a worker's
    monitoring sees it; each is logged with its error.
    """
    summary = maintenance.compact_threads(using=using)
    if summary is not None and summary.failed:
        raise maintenance.CompactionFailed(summary)
    return None if summary is None else asdict(summary)
