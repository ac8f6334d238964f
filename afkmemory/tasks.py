"""Celery tasks for the scheduled jobs; the project's beat schedule names them."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded

from . import maintenance

logger = logging.getLogger(__name__)


@shared_task(name="afkmemory.sweep_store", ignore_result=True)
def sweep_store(using: str | None = None, batch_size: int | None = None) -> int | None:
    """Delete expired store items (single-flight; idempotent, so safe to run twice).

    On ``using``, by default ``AFKMEMORY["DATABASE_ALIAS"]``. What it did goes to the worker's log.
    """
    removed = maintenance.sweep_store(using=using, batch_size=batch_size)
    if removed is None:
        logger.info("sweep skipped: another sweep holds the claim")
    else:
        logger.info("swept %s", maintenance.counted(removed, "expired store item"))
    return removed


@shared_task(name="afkmemory.compact_threads", ignore_result=True)
def compact_threads(using: str | None = None) -> dict[str, Any] | None:
    """Compact every thread over its budgets: events, old runs' checkpoints, graph checkpoints (single-flight).

    Threads that failed fail the task (after the others were compacted), so a worker's
    monitoring sees it; each is logged with its error. A soft time limit ends the run
    (it is not one thread's failure).
    """
    summary = maintenance.compact_threads(using=using, interrupts=(SoftTimeLimitExceeded,))
    if summary is None:
        logger.info("compaction skipped: another run holds the claim")
        return None
    logger.info("%s; %s failed", summary.describe(), summary.failed)
    if summary.failed:
        raise maintenance.CompactionFailed(summary)
    return asdict(summary)
