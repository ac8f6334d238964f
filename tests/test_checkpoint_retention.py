"""Graph checkpoint retention: CheckpointRetention, apply_retention, and the scheduled compaction applying it."""

from __future__ import annotations

import io
import threading
from datetime import timedelta

import pytest
from agentflow.checkpoint import Checkpoint
from django.core.management import call_command
from django.db import connections, transaction
from django.utils import timezone

from afkmemory import maintenance, models
from afkmemory.stores import CheckpointRetention, SyncDjangoCheckpointer

both = pytest.mark.parametrize("alias", ["default", "postgres"])


def _thread_of(alias: str, thread: str, steps: range, *, old: set[int], owner=None) -> SyncDjangoCheckpointer:
    """Checkpoints of ``thread`` at ``steps``; those in ``old`` last written 40 days ago."""
    saver = SyncDjangoCheckpointer(owner=owner, using=alias)
    for step in steps:
        saver.put(Checkpoint(thread=thread, step=step, state={"n": step}, ts=f"2026-01-01T00:00:{step:02d}+00:00"))
    ago = timezone.now() - timedelta(days=40)
    models.GraphCheckpoint.objects.using(alias).filter(thread__thread_id=thread, step__in=old).update(updated_at=ago)
    return saver


def _steps(saver: SyncDjangoCheckpointer, thread: str) -> list[int]:
    return [cp.step for cp in saver.history(thread)]


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_a_checkpoint_goes_only_when_past_the_latest_steps_and_old(alias, settings):
    settings.AFKMEMORY = {**settings.AFKMEMORY, "DELETE_BATCH_SIZE": 2}  # several batches
    saver = _thread_of(alias, "t", range(10), old={0, 1, 2, 4, 5, 6, 8, 9})
    removed = saver.apply_retention("t", CheckpointRetention(keep_steps=3, max_age_days=30))
    # Steps 7-9 are the latest three; of the others, 3 was written recently.
    assert removed == 6
    assert _steps(saver, "t") == [3, 7, 8, 9]
    assert saver.apply_retention("t", CheckpointRetention(keep_steps=3, max_age_days=30)) == 0
    # No more steps than it keeps: nothing goes, however old.
    short = _thread_of(alias, "short", range(3), old={0, 1, 2})
    assert short.apply_retention("short", CheckpointRetention(keep_steps=3, max_age_days=0)) == 0
    assert _steps(short, "short") == [0, 1, 2]
    assert saver.apply_retention("absent", CheckpointRetention()) == 0


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_an_age_bound_before_the_year_1_keeps_everything_and_the_job_runs(alias, settings):
    """``max_age_days=1_000_000`` ("in practice never by age") made the cutoff overflow: the
    hourly job failed before its first thread, event compaction and state pruning included."""
    settings.AFKMEMORY = {**settings.AFKMEMORY, "GRAPH_CHECKPOINT_RETENTION": {"keep_steps": 1, "max_age_days": 10**6}}
    saver = _thread_of(alias, "t", range(3), old={0, 1})
    summary = maintenance.compact_threads(using=alias, between=lambda: None)
    assert summary == maintenance.CompactionSummary(threads=0, events_removed=0, failed=0)
    for days in (10**6, 999_999_999, 1e300):  # the last two: past what timedelta takes
        assert saver.apply_retention("t", CheckpointRetention(keep_steps=1, max_age_days=days)) == 0
    assert _steps(saver, "t") == [0, 1, 2]


@pytest.mark.django_db(databases=["default", "postgres"])
def test_retention_is_per_owner_and_thread(django_user_model):
    alice = django_user_model.objects.db_manager("postgres").create(username="alice")
    mine = _thread_of("postgres", "t", range(4), old={0, 1, 2, 3}, owner=alice)
    nobodys = _thread_of("postgres", "t", range(4), old={0, 1, 2, 3})
    other = _thread_of("postgres", "u", range(4), old={0, 1, 2, 3}, owner=alice)
    assert mine.apply_retention("t", CheckpointRetention(keep_steps=1, max_age_days=1)) == 3
    assert (_steps(mine, "t"), _steps(nobodys, "t"), _steps(other, "u")) == ([3], [0, 1, 2, 3], [0, 1, 2, 3])


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"keep_steps": 0}, ValueError),
        ({"keep_steps": 1.5}, TypeError),
        ({"keep_steps": True}, TypeError),
        ({"max_age_days": -1}, ValueError),
        ({"max_age_days": float("nan")}, ValueError),
        ({"max_age_days": "30"}, ValueError),
    ],
)
def test_a_bad_retention_is_refused(fields, error):
    with pytest.raises(error):
        CheckpointRetention(**fields)


@pytest.mark.django_db(databases=["postgres"], transaction=True)
def test_a_step_written_again_while_the_retention_runs_is_kept():
    """Each DELETE repeats the age bound: a resumed run's rewrite of an old step, waited for, survives it."""
    saver = _thread_of("postgres", "t", range(6), old={0, 1, 2, 3})
    locked, done = threading.Event(), threading.Event()
    removed: list[int] = []

    def rewrite_step_1() -> None:  # another process resuming the run: step 1 written again, not yet committed
        with transaction.atomic(using="postgres"):
            models.GraphCheckpoint.objects.using("postgres").filter(step=1).update(updated_at=timezone.now())
            locked.set()
            done.wait(timeout=30)
        connections["postgres"].close()

    def prune() -> None:
        removed.append(saver.apply_retention("t", CheckpointRetention(keep_steps=2, max_age_days=30)))
        connections["postgres"].close()

    writer = threading.Thread(target=rewrite_step_1)
    writer.start()
    assert locked.wait(timeout=30)
    pruner = threading.Thread(target=prune)
    pruner.start()
    pruner.join(timeout=1)
    assert pruner.is_alive()  # waiting for the rewrite's row lock
    done.set()
    writer.join(timeout=30)
    pruner.join(timeout=30)
    assert removed == [3]  # steps 0, 2, 3: not step 1, written while the prune waited
    assert _steps(saver, "t") == [1, 4, 5]


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_scheduled_compaction_applies_graph_checkpoint_retention(alias, settings):
    """Checkpoint tables must not grow forever: the scheduled run applies GRAPH_CHECKPOINT_RETENTION."""
    settings.AFKMEMORY = {**settings.AFKMEMORY, "GRAPH_CHECKPOINT_RETENTION": {"keep_steps": 2, "max_age_days": 7}}
    busy = _thread_of(alias, "busy", range(5), old={0, 1, 2, 3, 4})
    _thread_of(alias, "recent", range(5), old=set())  # long, but every step recent: not visited
    _thread_of(alias, "short", range(2), old={0, 1})  # old, but no more steps than kept
    busy_pk = models.Thread.objects.using(alias).get(thread_id="busy").pk
    assert maintenance.threads_over_checkpoint_budget(CheckpointRetention(2, 7), using=alias) == [busy_pk]
    summary = maintenance.compact_threads(using=alias, between=lambda: None)
    assert summary == maintenance.CompactionSummary(1, 0, 0, 0, graph_checkpoints_removed=3)
    assert _steps(busy, "busy") == [3, 4]
    assert [_steps(busy, t) for t in ("recent", "short")] == [[0, 1, 2, 3, 4], [0, 1]]
    settings.AFKMEMORY = {**settings.AFKMEMORY, "GRAPH_CHECKPOINT_RETENTION": None}  # off: every checkpoint stays
    _thread_of(alias, "busy", range(5, 7), old={3, 4, 5})
    assert maintenance.compact_threads(using=alias, between=lambda: None).graph_checkpoints_removed == 0
    assert _steps(busy, "busy") == [3, 4, 5, 6]


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_the_compact_command_counts_the_graph_checkpoints_it_removed(settings):
    settings.AFKMEMORY = {**settings.AFKMEMORY, "GRAPH_CHECKPOINT_RETENTION": {"keep_steps": 2, "max_age_days": 7}}
    _thread_of("default", "t", range(5), old={0, 1, 2, 3, 4})
    out = io.StringIO()
    call_command("afkmemory_compact_threads", stdout=out)
    assert out.getvalue() == "Compacted 1 thread, removed 0 events and 3 old graph checkpoints.\n"


@pytest.mark.django_db(databases=["default"])
def test_the_default_keeps_a_hundred_steps_and_a_month():
    assert CheckpointRetention() == CheckpointRetention(keep_steps=100, max_age_days=30)
    saver = _thread_of("default", "t", range(101), old={0, 1})
    summary = maintenance.compact_threads(between=lambda: None)
    assert summary is not None and summary.graph_checkpoints_removed == 1  # step 0: step 1 is in the latest 100
    assert _steps(saver, "t")[:2] == [1, 2]
