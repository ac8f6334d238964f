"""The scheduled jobs: single-flight claims, the store sweep, thread compaction, a real Celery worker."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from celery import Celery
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import OperationalError, connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from afkmemory import maintenance, models, tasks
from afkmemory.memory import MemoryEvent, RetentionPolicy, StateRetentionPolicy
from afkmemory.namespaces import encode
from afkmemory.querysets import StoreItemQuerySet
from afkmemory.stores import CheckpointRetention, SyncDjangoCheckpointer, SyncDjangoMemoryStore, SyncDjangoStore
from tests.redis_server import require_redis

ROOT = Path(__file__).resolve().parent.parent
both = pytest.mark.parametrize("alias", ["default", "postgres"])


def _expired_and_live(alias: str, owner=None) -> None:
    store = SyncDjangoStore(owner=owner, using=alias)
    store.put(("cache",), "live", 1, ttl=3600)
    store.put(("cache",), "forever", 2)
    past = timezone.now() - timedelta(seconds=5)
    for i in range(7):
        models.StoreItem.objects.using(alias).create(
            owner=owner, namespace=encode(("cache",)), key=f"old{i}", value=i, created_at=past, updated_at=past,
            expires_at=past,
        )  # fmt: skip


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_single_flight_admits_one_holder_and_releases(alias):
    with maintenance.single_flight("job", using=alias) as first:
        with maintenance.single_flight("job", using=alias) as second:
            assert first is not None and second is None
        with maintenance.single_flight("other-job", using=alias) as other:
            assert other
    with maintenance.single_flight("job", using=alias) as again:
        assert again  # released on exit


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_an_expired_claim_is_taken_over(alias):
    with maintenance.single_flight("job", using=alias, lease=0.000001) as crashed_holder:
        assert crashed_holder
        time.sleep(0.01)  # the lease runs out while the holder still "runs"
        with maintenance.single_flight("job", using=alias) as successor:
            assert successor
    # The first holder's release must not delete the successor's claim.
    assert SyncDjangoStore(using=alias).get(maintenance.JOB_NAMESPACE, "job") is None  # successor released its own


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_a_job_that_keeps_its_claim_outlasts_the_lease_and_one_that_lost_it_stops(alias):
    with maintenance.single_flight("job", using=alias, lease=2) as claim:
        time.sleep(1.2)
        assert claim.keep()  # renewed: two seconds from now
        time.sleep(1.2)  # past the first lease
        with maintenance.single_flight("job", using=alias) as other:
            assert other is None
        models.StoreItem.objects.using(alias).filter(key="job").delete()  # lapsed and swept, say
        time.sleep(0.3)
        assert not claim.keep()


@pytest.mark.django_db(databases=["default"])
def test_a_run_whose_lease_ran_out_in_its_last_thread_leaves_the_marks_of_the_run_that_took_over(monkeypatch):
    """Run A's last thread outlasted its lease; run B took the claim and a thread of B's failed
    (its marks say to retry it). A then saved its own marks over B's: B's failed thread was not
    retried until the daily full check (helper-92's review)."""
    store = SyncDjangoMemoryStore()
    for thread in ("a-slow", "b-fails"):
        store.append_events([MemoryEvent(f"e{i}", thread, None, "message", i, {}, []) for i in range(5)])
    policy = RetentionPolicy(max_events_per_thread=2)
    compact, in_b = SyncDjangoMemoryStore.compact_thread, []

    def compact_thread(self, thread_id, given):
        if thread_id == "b-fails" and in_b:
            raise RuntimeError("run B fails this thread")
        if thread_id == "b-fails":  # run A's last thread: its lease runs out, run B starts and ends
            models.StoreItem.objects.filter(key="compact-threads").update(
                expires_at=timezone.now() - timedelta(seconds=1)
            )
            in_b.append(1)
            assert maintenance.compact_threads(policy=policy, between=lambda: None).failed == 1
            in_b.clear()
        return compact(self, thread_id, given)

    monkeypatch.setattr(SyncDjangoMemoryStore, "compact_thread", compact_thread)
    assert maintenance.compact_threads(policy=policy, between=lambda: None).threads == 2
    marks = SyncDjangoStore().get(maintenance.MARKS_NAMESPACE, maintenance.MARKS_KEY)
    assert marks is not None and marks.value["retry"] == [models.Thread.objects.get(thread_id="b-fails").pk]


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_a_compaction_that_lost_its_claim_stops_and_leaves_the_rest_to_the_next_run(alias, settings):
    settings.AFKMEMORY = {**settings.AFKMEMORY, "JOB_LEASE_SECONDS": 1}
    store = SyncDjangoMemoryStore(using=alias)
    for thread in ("a", "b", "c"):
        store.append_events([MemoryEvent(f"e{i}", thread, None, "message", i, {}, []) for i in range(3)])
    calls = []

    def between() -> None:
        calls.append(1)
        time.sleep(0.15)  # past a tenth of the lease: each thread renews the claim
        if len(calls) == 2:
            models.StoreItem.objects.using(alias).filter(key="compact-threads").delete()

    policy = RetentionPolicy(max_events_per_thread=1)
    summary = maintenance.compact_threads(using=alias, policy=policy, between=between)
    assert summary == maintenance.CompactionSummary(threads=1, events_removed=2, failed=0)
    assert [len(store.get_recent_events(t, 10)) for t in ("a", "b", "c")] == [1, 3, 3]
    assert maintenance.compact_threads(using=alias, policy=policy, between=lambda: None).threads == 2


@pytest.mark.django_db(databases=["postgres"], transaction=True)
def test_a_job_whose_connection_broke_still_releases_its_claim_and_keeps_its_error():
    """A database restart mid-job: the release reconnects, so the next run need not wait out the lease."""
    from django.db import OperationalError, connections

    with pytest.raises(OperationalError), maintenance.single_flight("job", using="postgres") as won:
        assert won
        with connections["postgres"].cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")  # the server drops this session
    assert SyncDjangoStore(using="postgres").get(maintenance.JOB_NAMESPACE, "job") is None
    with maintenance.single_flight("job", using="postgres") as next_run:
        assert next_run


def _release_fails(monkeypatch: pytest.MonkeyPatch, times: int | None = None) -> list[int]:
    """Fail store item deletes (a claim's release) as on a server that is restarting: the first
    ``times`` (None: every one); return the tries made."""
    tries: list[int] = []
    delete = StoreItemQuerySet.delete

    def restarting(queryset: StoreItemQuerySet) -> tuple[int, dict[str, int]]:
        tries.append(1)
        if times is None or len(tries) <= times:
            raise OperationalError("the database system is shutting down")
        return delete(queryset)

    monkeypatch.setattr(StoreItemQuerySet, "delete", restarting)
    return tries


def _leave_an_ended_runs_claim(alias: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run ``job`` in this process while its database stays down past the release's retries; return its token."""
    monkeypatch.setattr(maintenance, "RELEASE_RETRY_SECONDS", 0.3)
    with monkeypatch.context() as down:
        _release_fails(down)
        with maintenance.single_flight("job", using=alias) as ended:
            assert ended
    assert SyncDjangoStore(using=alias).get(maintenance.JOB_NAMESPACE, "job").value["token"] == ended.token
    return ended.token


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@both
def test_a_release_goes_on_trying_while_the_database_restarts(alias, monkeypatch):
    """A restart takes seconds: the release, tried twice within milliseconds, gave up, and every
    run was skipped until the lease ended (an hour)."""
    tries = _release_fails(monkeypatch, times=3)
    with maintenance.single_flight("job", using=alias) as claim:
        assert claim
    assert len(tries) == 4
    assert SyncDjangoStore(using=alias).get(maintenance.JOB_NAMESPACE, "job") is None


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@both
def test_a_claim_this_process_could_not_release_is_taken_over_by_its_next_run(alias, monkeypatch, caplog):
    """The database down past the release's retries: the claim stayed, and as its holder, this
    worker, still runs, the crashed-holder takeover did not apply: skipped for the lease (an hour)."""
    caplog.set_level(logging.WARNING, logger="afkmemory.maintenance")
    began = time.monotonic()
    ended = _leave_an_ended_runs_claim(alias, monkeypatch)
    assert time.monotonic() - began < 5  # the release's retries are bounded
    with maintenance.single_flight("job", using=alias) as next_run:
        assert next_run is not None and next_run.token != ended
        with maintenance.single_flight("job", using=alias) as beside:  # the new holder's claim is live
            assert beside is None
    assert "could not release the claim of job job: this process's next run takes it over" in caplog.text
    assert "job job was claimed by an earlier run of this process, which could not release it" in caplog.text
    assert SyncDjangoStore(using=alias).get(maintenance.JOB_NAMESPACE, "job") is None  # the next run released it


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@both
def test_a_claim_of_a_job_running_in_another_thread_of_this_process_is_not_taken_over(alias, monkeypatch):
    """Celery's threads pool runs tasks in threads of one process: a claim this process took is
    live while its run goes on in any thread, so only one run holds the job."""
    _leave_an_ended_runs_claim(alias, monkeypatch)
    running, finish = threading.Event(), threading.Event()
    held: list[maintenance.Claim | None] = []

    def run_in_a_thread() -> None:
        try:
            with maintenance.single_flight("job", using=alias) as claim:
                held.append(claim)
                running.set()
                finish.wait(30)
        finally:
            running.set()
            connections.close_all()

    thread = threading.Thread(target=run_in_a_thread)
    thread.start()
    try:
        assert running.wait(30)
        assert held and held[0] is not None  # it took the ended run's claim over
        with maintenance.single_flight("job", using=alias) as beside:
            assert beside is None  # the thread's run is under way
    finally:
        finish.set()
        thread.join(30)
    assert SyncDjangoStore(using=alias).get(maintenance.JOB_NAMESPACE, "job") is None  # the thread released it
    with maintenance.single_flight("job", using=alias) as after:
        assert after


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@both
def test_a_child_forked_inside_the_block_neither_releases_nor_renews_its_parents_claim(alias):
    """os.fork() inside the block (a prefork pool, multiprocessing's fork start method): the child
    inherited the block, and its copy's end released the parent's claim, so a second scheduler
    could start the job while the parent still ran it."""
    child, outcome = -1, 1
    try:
        with maintenance.single_flight("job", using=alias) as claim:
            assert claim
            taken = maintenance._claims("job", alias).get().updated_at
            child = os.fork()
            if child == 0:
                claim.renewed -= claim.lease  # a renewal is due: only the parent may make it
                with maintenance.single_flight("job", using=alias) as own:  # the child's own run
                    outcome = 2 if claim.keep() else 3 if own else 0
            else:
                _, status = os.waitpid(child, 0)  # the child has left its copy of the block
                assert os.waitstatus_to_exitcode(status) == 0  # keep() said the claim is not its, its run skipped
                held = maintenance._claims("job", alias).get()
                assert held.value["token"] == claim.token and held.updated_at == taken
                with maintenance.single_flight("job", using=alias) as second:
                    assert second is None  # the parent's run is under way
    finally:
        if child == 0:  # never back into pytest from the child
            os._exit(outcome)
    assert SyncDjangoStore(using=alias).get(maintenance.JOB_NAMESPACE, "job") is None  # the parent released it


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_sweep_deletes_every_accounts_expired_items_only(alias):
    user = get_user_model().objects.db_manager(alias).create_user("tenant")
    _expired_and_live(alias)
    _expired_and_live(alias, owner=user)
    assert maintenance.sweep_store(using=alias, batch_size=3) == 14
    assert sorted(models.StoreItem.objects.using(alias).values_list("key", flat=True)) == [
        "forever", "forever", "live", "live",
    ]  # fmt: skip
    with maintenance.single_flight("sweep-store", using=alias):
        assert maintenance.sweep_store(using=alias) is None  # another sweep holds the claim


def _gone_pid() -> int:
    """The id of a process that has ended."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(gone.stdout)


def _claim(job: str, pid: int, **more: object) -> None:
    """Leave ``job``'s claim as a process ``pid`` of this host, boot and pid namespace would (``more`` overrides)."""
    holder = {"token": "t", "pid": pid, "started": maintenance._started(pid), **maintenance._process_space(), **more}
    SyncDjangoStore().put(maintenance.JOB_NAMESPACE, job, holder, ttl=600)


def _held_by(job: str) -> dict:
    return SyncDjangoStore().get(maintenance.JOB_NAMESPACE, job).value


@pytest.mark.django_db(databases=["default"])
def test_a_claim_left_by_a_crashed_process_of_this_host_is_taken_over(caplog):
    """A worker killed mid-job (kill -9, the OOM killer, `make run` stopped past its grace) left
    its claim: every run was skipped until the lease ended, an hour by default."""
    gone = _gone_pid()
    _claim("sweep-store", gone)
    _claim("compact-threads", os.getpid())  # alive
    caplog.set_level(logging.WARNING, logger="afkmemory.maintenance")
    assert maintenance.sweep_store() == 0  # it ran
    assert maintenance.compact_threads() is None  # its holder runs: skipped
    [warning] = [record for record in caplog.records if record.name == "afkmemory.maintenance"]
    assert f"job sweep-store was claimed by process {gone} of this host, which is not running" in warning.getMessage()
    assert SyncDjangoStore().get(maintenance.JOB_NAMESPACE, "sweep-store") is None  # the run released it
    assert _held_by("compact-threads")["pid"] == os.getpid()


@pytest.mark.django_db(databases=["default"])
def test_a_claim_whose_pid_another_process_took_since_is_taken_over():
    _claim("sweep-store", os.getpid(), started="0")  # this pid, but a process that started at boot
    assert maintenance.sweep_store() == 0


@pytest.mark.django_db(databases=["default"])
@pytest.mark.parametrize(
    "elsewhere",
    [{"boot_id": "another machine or boot"}, {"pid_namespace": "pid:[1]"}, {"boot_id": None, "pid_namespace": None}],
    ids=["another-boot", "another-container", "not-linux"],
)
def test_a_claim_of_a_pid_this_process_cannot_judge_is_left_to_its_lease(caplog, elsewhere):
    """A machine of the same name (cloned, or outside containers, where every host has the same
    initial pid namespace), another container: the pid is another process space's."""
    _claim("sweep-store", _gone_pid(), **elsewhere)
    caplog.set_level(logging.DEBUG, logger="afkmemory.maintenance")
    assert maintenance.sweep_store() is None
    assert [record for record in caplog.records if record.levelno >= logging.WARNING] == []
    assert _held_by("sweep-store")["token"] == "t"


@pytest.mark.django_db(databases=["default"])
def test_a_gone_process_claim_of_an_earlier_version_is_named_with_how_to_run_sooner(caplog):
    import socket

    gone = _gone_pid()
    holder = {"token": "t", "host": socket.gethostname(), "pid": gone}  # as claims were written before
    SyncDjangoStore().put(maintenance.JOB_NAMESPACE, "sweep-store", holder, ttl=600)
    caplog.set_level(logging.WARNING, logger="afkmemory.maintenance")
    assert maintenance.sweep_store() is None
    [warning] = [record.getMessage() for record in caplog.records]
    assert f"job sweep-store is claimed by process {gone} of this host" in warning
    assert "delete the store item afkmemory/jobs / sweep-store" in warning


@pytest.mark.django_db(databases=["default"])
def test_a_gone_holders_claim_taken_by_another_run_first_is_not_taken_again(monkeypatch):
    _claim("sweep-store", _gone_pid())
    holder = _held_by("sweep-store")
    read = SyncDjangoStore.get

    def then_another_run_takes_it(store, namespace, key):
        item = read(store, namespace, key)
        SyncDjangoStore().put(maintenance.JOB_NAMESPACE, "sweep-store", {**holder, "token": "another"}, ttl=600)
        return item

    monkeypatch.setattr(SyncDjangoStore, "get", then_another_run_takes_it)
    with maintenance.single_flight("sweep-store") as claim:
        assert claim is None
    monkeypatch.undo()
    assert _held_by("sweep-store")["token"] == "another"


@pytest.mark.django_db(databases=["default"])
def test_a_task_skipped_for_a_run_under_way_says_so_in_the_workers_log(caplog):
    caplog.set_level(logging.INFO, logger="afkmemory.tasks")
    with maintenance.single_flight("sweep-store"), maintenance.single_flight("compact-threads"):
        assert tasks.sweep_store() is None and tasks.compact_threads() is None
    assert "sweep skipped: another sweep holds the claim" in caplog.text
    assert "compaction skipped: another run holds the claim" in caplog.text


@pytest.mark.django_db(databases=["default"])
@pytest.mark.parametrize(("name", "value"), [("JOB_LEASE_SECONDS", None), ("JOB_LEASE_SECONDS", 0),
                                             ("DELETE_BATCH_SIZE", 0), ("DELETE_BATCH_SIZE", "500")])  # fmt: skip
def test_a_job_with_a_bad_setting_stops_before_it_claims_or_deletes_anything(settings, name, value):
    """Workers run without system checks (E006): a lease of None kept the job's claim forever
    (the release failed on it), 0 let two runs through at once, and a batch size of 0 reported
    rows deleted that were not."""
    _expired_and_live("default")
    store = SyncDjangoMemoryStore()
    for i in range(8):
        store.append_event(MemoryEvent(f"e{i}", "t1", None, "message", i, {}, []))
    settings.AFKMEMORY = {**settings.AFKMEMORY, name: value, "COMPACTION_POLICY": {"max_events_per_thread": 2}}
    message = re.escape(f"AFKMEMORY['{name}'] must be a whole number")
    for job in (maintenance.compact_threads, maintenance.sweep_store):
        with pytest.raises(ImproperlyConfigured, match=message):
            job()
    if name == "DELETE_BATCH_SIZE":
        with pytest.raises(ImproperlyConfigured, match=message):
            store.compact_thread("t1", RetentionPolicy(max_events_per_thread=2))
        with pytest.raises(ImproperlyConfigured, match=message):
            store.delete_long_term_memories("u1")
    assert not models.StoreItem.objects.filter(namespace=encode(maintenance.JOB_NAMESPACE)).exists()  # no claim
    assert models.Event.objects.count() == 8 and models.StoreItem.objects.filter(key__startswith="old").count() == 7


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@both
def test_compact_threads_trims_only_threads_over_budget(alias):
    user = get_user_model().objects.db_manager(alias).create_user("tenant")
    big = SyncDjangoMemoryStore(owner=user, using=alias)
    small = SyncDjangoMemoryStore(using=alias)
    for i in range(30):
        big.append_event(MemoryEvent(f"e{i}", "big", None, "message", i, {}, []))
    for i in range(5):
        small.append_event(MemoryEvent(f"e{i}", "small", None, "message", i, {}, []))
    policy = RetentionPolicy(max_events_per_thread=10)
    calls: list[int] = []
    summary = maintenance.compact_threads(using=alias, policy=policy, between=lambda: calls.append(1))
    assert summary == maintenance.CompactionSummary(threads=1, events_removed=20, failed=0)
    assert calls == [1]
    assert [e.id for e in big.get_recent_events("big", 100)] == [f"e{i}" for i in range(20, 30)]
    assert len(small.get_recent_events("small", 100)) == 5


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_a_thread_the_store_refuses_is_logged_and_the_run_goes_on(alias, monkeypatch, caplog):
    """A thread id edited past the store's byte limit (the column counts characters) fails that thread alone."""
    monkeypatch.setattr(maintenance, "IDS_PER_QUERY", 2)  # several reads of threads
    odd = models.Thread.objects.using(alias).create(thread_id="é" * 200)  # 400 bytes in UTF-8
    models.Event.objects.using(alias).bulk_create(
        [models.Event(thread=odd, event_id=f"e{i}", type="message", timestamp=i) for i in range(5)]
    )
    store = SyncDjangoMemoryStore(using=alias)
    for name in ("a", "b", "c"):
        for i in range(5):
            store.append_event(MemoryEvent(f"e{i}", name, None, "message", i, {}, []))
    summary = maintenance.compact_threads(
        using=alias, policy=RetentionPolicy(max_events_per_thread=2), between=lambda: None
    )
    assert summary == maintenance.CompactionSummary(threads=3, events_removed=9, failed=1)
    assert [len(store.get_recent_events(name)) for name in ("a", "b", "c")] == [2, 2, 2]
    assert "the limit is 255" in caplog.text and "going on" in caplog.text


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_a_soft_time_limit_ends_the_task_instead_of_failing_one_thread(settings, monkeypatch):
    """Celery raises SoftTimeLimitExceeded wherever the task is: the run logged it as that
    thread's failure and went on to the next thread, past the limit it was given."""
    from celery.exceptions import SoftTimeLimitExceeded

    settings.AFKMEMORY = {**settings.AFKMEMORY, "COMPACTION_POLICY": {"max_events_per_thread": 1}}
    store = SyncDjangoMemoryStore()
    for name in ("a", "b"):
        store.append_events([MemoryEvent(f"e{i}", name, None, "message", i, {}, []) for i in range(3)])
    compact_thread = SyncDjangoMemoryStore.compact_thread

    def limit_reached(self, thread_id, policy):
        compact_thread(self, thread_id, policy)  # its batch written, then the limit
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(SyncDjangoMemoryStore, "compact_thread", limit_reached)
    with pytest.raises(SoftTimeLimitExceeded):
        tasks.compact_threads()
    assert sorted(len(store.get_recent_events(name)) for name in ("a", "b")) == [1, 3]  # one thread, not both
    assert not models.StoreItem.objects.filter(key="compact-threads").exists()  # the claim released


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_failed_threads_fail_the_command_and_the_task(settings):
    """Cron and a worker's monitoring see it: a failing exit status, a failed task."""
    settings.AFKMEMORY = {**settings.AFKMEMORY, "COMPACTION_POLICY": {"max_events_per_thread": 1}}
    odd = models.Thread.objects.create(thread_id="é" * 200)  # 400 bytes in UTF-8: the store refuses it
    models.Event.objects.bulk_create(
        [models.Event(thread=odd, event_id=f"e{i}", type="message", timestamp=i) for i in range(3)]
    )
    with pytest.raises(CommandError, match="Compacted 0 threads, removed 0 events; 1 failed"):
        call_command("afkmemory_compact_threads")
    with pytest.raises(maintenance.CompactionFailed, match="1 thread failed"):
        tasks.compact_threads()


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_compaction_prunes_the_old_runs_of_threads_with_more_runs_than_the_state_policy_keeps(alias, settings):
    """Checkpoint tables must not grow forever: the scheduled run applies STATE_RETENTION_POLICY."""
    settings.AFKMEMORY = {**settings.AFKMEMORY, "STATE_RETENTION_POLICY": {"max_runs": 2}}
    store = SyncDjangoMemoryStore(using=alias)
    for run_index in range(4):  # four runs, each with a checkpoint and an effect
        store.write_checkpoint("busy", f"run-{run_index}", 0, "pre_llm", {"run": run_index})
        store.put_state("busy", f"effect:run-{run_index}:0:call", {"input_hash": "h", "output": run_index})
        time.sleep(0.002)  # the latest pointers' timestamps order the runs
    for run_index in range(2):
        store.write_checkpoint("quiet", f"run-{run_index}", 0, "pre_llm", {})
    store.put_state("busy", "notes", "kept")
    summary = maintenance.compact_threads(using=alias, between=lambda: None)
    # run-0 and run-1 of "busy" lose their checkpoint, pointer and effect; "quiet" is not visited.
    assert summary == maintenance.CompactionSummary(threads=1, events_removed=0, failed=0, state_keys_removed=6)
    assert sorted(store.list_state("busy")) == [
        "checkpoint:run-2:0:pre_llm", "checkpoint:run-2:latest", "checkpoint:run-3:0:pre_llm",
        "checkpoint:run-3:latest", "effect:run-2:0:call", "effect:run-3:0:call", "notes",
    ]  # fmt: skip
    assert len(store.list_state("quiet")) == 4
    settings.AFKMEMORY = {**settings.AFKMEMORY, "STATE_RETENTION_POLICY": None}  # off: every checkpoint stays
    store.write_checkpoint("quiet", "run-9", 0, "pre_llm", {})
    assert maintenance.threads_over_state_budget(StateRetentionPolicy(max_runs=2), using=alias) == [
        models.Thread.objects.using(alias).get(thread_id="quiet").pk
    ]
    assert maintenance.compact_threads(using=alias, between=lambda: None).state_keys_removed == 0
    # A run of more effects than the policy keeps is pruned too, whatever the number of runs.
    for i in range(4):
        store.put_state("quiet", f"effect:run-9:{i}:call", {"output": i})
    assert (
        maintenance.compact_threads(
            using=alias, state_policy=StateRetentionPolicy(max_effect_entries_per_run=2), between=lambda: None
        ).state_keys_removed
        == 2
    )


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_compact_command_uses_the_configured_policy(settings):
    settings.AFKMEMORY = {**settings.AFKMEMORY, "COMPACTION_POLICY": {"max_events_per_thread": 3}}
    store = SyncDjangoMemoryStore()
    for i in range(8):
        store.append_event(MemoryEvent(f"e{i}", "t", None, "message", i, {}, []))
    out = io.StringIO()
    call_command("afkmemory_compact_threads", stdout=out)
    assert [e.id for e in store.get_recent_events("t", 100)] == ["e5", "e6", "e7"]
    assert out.getvalue() == "Compacted 1 thread, removed 5 events.\n"
    for command in ("afkmemory_compact_threads", "afkmemory_sweep_store"):  # -v 0, for cron: silent
        quiet = io.StringIO()
        call_command(command, verbosity=0, stdout=quiet)
        assert quiet.getvalue() == ""


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_the_commands_count_one_thing_in_the_singular_and_more_in_the_plural(settings):
    """'Compacted 1 threads' read as a slip; the sweep's count already agreed."""
    settings.AFKMEMORY = {**settings.AFKMEMORY, "COMPACTION_POLICY": {"max_events_per_thread": 2}}
    store = SyncDjangoMemoryStore()
    for thread in ("a", "b"):
        store.append_events([MemoryEvent(f"e{i}", thread, None, "message", i, {}, []) for i in range(3)])
    out = io.StringIO()
    call_command("afkmemory_compact_threads", stdout=out)
    assert out.getvalue() == "Compacted 2 threads, removed 2 events.\n"
    store.append_event(MemoryEvent("e3", "a", None, "message", 3, {}, []))
    out = io.StringIO()
    call_command("afkmemory_compact_threads", stdout=out)
    assert out.getvalue() == "Compacted 1 thread, removed 1 event.\n"
    past = timezone.now() - timedelta(seconds=5)
    models.StoreItem.objects.create(
        namespace=encode(("cache",)), key="old", value=0, created_at=past, updated_at=past, expires_at=past
    )
    out = io.StringIO()
    call_command("afkmemory_sweep_store", stdout=out)
    assert out.getvalue() == "Deleted 1 expired store item from 'default'.\n"


@pytest.mark.parametrize("command", ["afkmemory_compact_threads", "afkmemory_sweep_store", "afkmemory_rebuild_indexes"])
def test_an_unknown_database_is_a_usage_error(command):
    with pytest.raises(CommandError, match="no database 'nope'; the aliases are default"):
        call_command(command, "--database", "nope")


@pytest.mark.slow
@pytest.mark.django_db(databases=["default"], transaction=True)
@pytest.mark.parametrize("broker", ["filesystem", "redis"])
def test_a_real_worker_runs_the_sweep(tmp_path, broker):
    """Start a Celery worker of the example project and send it the task: on the broker `make run`
    uses (the filesystem, no server), and on Redis, what REDIS_URL turns on to scale out."""
    _expired_and_live("default")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "AFKMEMORY_TEST_DATABASES": json.dumps(settings.DATABASES, default=str),
        "AFKMEMORY_VAR_DIR": str(tmp_path),
        "REDIS_URL": "",
    }
    queue = f"afkmemory-test-{uuid.uuid4().hex}"  # a shared Redis may have other workers
    if broker == "redis":
        url = require_redis()
        env["REDIS_URL"] = url
        producer = Celery("producer", broker=url)
    else:
        folder = tmp_path / "broker"
        producer = Celery("producer", broker="filesystem://")
        producer.conf.broker_transport_options = {
            "data_folder_in": str(folder / "out"), "data_folder_out": str(folder / "out"),
            "control_folder": str(folder / "control"), "store_processed": False,
        }  # fmt: skip
        for name in ("out", "processed", "control"):
            (folder / name).mkdir(parents=True)
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "project", "worker", "--pool=solo", "--loglevel=INFO", "-Q", queue],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        producer.send_task("afkmemory.sweep_store", queue=queue)
        deadline = time.monotonic() + 90  # a bound on waiting, not a timing assertion
        while models.StoreItem.objects.expired().exists() and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.2)
        remaining = sorted(models.StoreItem.objects.values_list("key", flat=True))
    finally:
        worker.terminate()
        output = worker.communicate(timeout=30)[0]
    assert remaining == ["forever", "live"], output[-3000:]
    assert "afkmemory.sweep_store" in output and "swept 7 expired store items" in output


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_the_job_prunes_what_a_policy_keeping_fewer_phases_drops(alias, settings):
    """The job visited only threads with too many runs or effects: with ``always_keep_phases``
    narrowed, one long run's runtime states (and checkpoints of an unkept phase) grew forever."""
    fields = {"always_keep_phases": ["run_terminal"], "max_runtime_states_per_run": 2}
    settings.AFKMEMORY = {**settings.AFKMEMORY, "STATE_RETENTION_POLICY": fields}
    store = SyncDjangoMemoryStore(using=alias)
    for step in range(10):
        store.write_checkpoint("long", "run-1", step, "runtime_state", {"step": step})
    for step in range(3):
        store.write_checkpoint("phases", "run-1", step, "pre_llm", {"step": step})
    store.write_checkpoint("kept", "run-1", 0, "pre_llm", {})  # of the latest step: stays, and is not visited
    assert len(maintenance.threads_over_state_budget(StateRetentionPolicy(**fields), using=alias)) == 2
    summary = maintenance.compact_threads(using=alias, between=lambda: None)
    assert summary is not None and summary.state_keys_removed == 8 + 2
    assert [c.step for c in store.list_checkpoints("long", "run-1")] == [8, 9]
    assert [c.step for c in store.list_checkpoints("phases", "run-1")] == [2]
    assert [c.step for c in store.list_checkpoints("kept", "run-1")] == [0]
    # What a prune keeps does not choose its thread again: each hourly run visited every thread
    # whose latest checkpoint had an unkept phase, and removed nothing (100,000 threads: 40 min).
    assert maintenance.threads_over_state_budget(StateRetentionPolicy(**fields), using=alias) == []
    assert maintenance.compact_threads(using=alias, between=lambda: None) == maintenance.CompactionSummary(
        threads=0, events_removed=0, failed=0, state_keys_removed=0
    )
    settings.AFKMEMORY = {**settings.AFKMEMORY, "STATE_RETENTION_POLICY": {}}  # AFK's: every phase it writes
    assert maintenance.threads_over_state_budget(StateRetentionPolicy(), using=alias) == []


def test_the_commands_are_silent_at_verbosity_0_in_the_example_project(tmp_path):
    """Cron mails any output: the summaries went to the example project's console log at INFO.
    The Celery tasks log them (a worker's log); the commands print them unless -v 0.

    Each process runs its command lines one after the other, as ``manage.py`` would (one
    process each would start Django eight times over).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_URL", "REDIS_URL", "AFK"))}
    env.update(DJANGO_SETTINGS_MODULE="project.settings", AFKMEMORY_VAR_DIR=str(tmp_path))
    root = Path(__file__).resolve().parent.parent
    commands = ("afkmemory_sweep_store", "afkmemory_compact_threads")

    def manage(*command_lines: list[str]) -> subprocess.CompletedProcess[str]:
        script = "import sys; from django.core.management import execute_from_command_line as run\n"
        script += "".join(f"run(['manage.py', *{line!r}])\n" for line in command_lines)
        return subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True)

    # Another run holds both claims (a beat job under way): skipped, silently too.
    hold = "from afkmemory.stores import SyncDjangoStore as S; [S().put(%r, j, {}, ttl=60) for j in %r]"
    held = hold % (maintenance.JOB_NAMESPACE, ["sweep-store", "compact-threads"])
    quiet = [[command, "-v", "0"] for command in commands]
    done = manage(["migrate", "-v", "0"], *quiet, ["shell", "-v", "0", "-c", held], *quiet)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    loud = manage(*[[command] for command in commands])
    assert loud.returncode == 0, loud.stderr
    assert loud.stdout.count("holds the claim; nothing done.") == 2, loud.stdout


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)  # the task closes old connections
def test_the_jobs_run_on_the_database_alias_by_default(settings):
    """They ran on "default" whatever AFKMEMORY["DATABASE_ALIAS"] said, where the API and the
    factory keep the memory: a project keeping it elsewhere swept and compacted the wrong one."""
    settings.AFKMEMORY = {**settings.AFKMEMORY, "DATABASE_ALIAS": "postgres"}
    store = SyncDjangoStore(using="postgres")
    store.put(("cache",), "gone", 1, ttl=0)
    assert tasks.sweep_store() == 1 and not models.StoreItem.objects.using("postgres").exists()
    memory = SyncDjangoMemoryStore(using="postgres")
    memory.append_events([MemoryEvent(f"e{i}", "t", None, "message", i, {}, []) for i in range(3)])
    settings.AFKMEMORY = {**settings.AFKMEMORY, "COMPACTION_POLICY": {"max_events_per_thread": 1}}
    assert tasks.compact_threads()["events_removed"] == 2
    out = io.StringIO()
    call_command("afkmemory_sweep_store", stdout=out)
    assert "from 'postgres'" in out.getvalue()


class AfkmemoryOnPostgresOnly:
    """Keep afkmemory's tables out of "default" (the test database still has them: an old copy)."""

    def allow_migrate(self, db, app_label, **hints):
        return db == "postgres" if app_label == "afkmemory" else None


@pytest.mark.django_db(databases=["default", "postgres"])
def test_a_job_or_command_on_a_database_the_routers_keep_afkmemory_out_of_is_refused(settings):
    """The jobs and commands ran on such an alias: with no tables there a raw "no such table",
    with an old copy of them a sweep and compaction of the copy (helper-92's review)."""
    _expired_and_live("default")  # the old copy
    settings.DATABASE_ROUTERS = [f"{__name__}.AfkmemoryOnPostgresOnly"]
    message = "database 'default' does not hold afkmemory's tables"
    for job in (tasks.sweep_store, tasks.compact_threads):
        with pytest.raises(ImproperlyConfigured, match=message):
            job(using="default")
    for command in ("afkmemory_sweep_store", "afkmemory_compact_threads", "afkmemory_refresh_search_text"):
        with pytest.raises(CommandError, match=message):
            call_command(command, "--database", "default")
    assert models.StoreItem.objects.using("default").count() == 9  # nothing swept, no claim
    assert tasks.sweep_store(using="postgres") == 0  # where they live


GROWING_TABLES = ("afkmemory_event", "afkmemory_checkpoint", "afkmemory_effect", "afkmemory_graphcheckpoint")


def _quiet_threads(alias: str, threads: int = 300) -> None:
    """Threads under every budget: events, checkpoints, effects and graph checkpoints of each."""
    models.Thread.objects.using(alias).bulk_create([models.Thread(thread_id=f"q{i}") for i in range(threads)])
    made = list(models.Thread.objects.using(alias).filter(thread_id__startswith="q"))
    for model, each, of_thread in [
        (models.Event, 30, lambda t, i: models.Event(thread=t, event_id=f"e{i}", type="message", timestamp=i)),
        (models.Checkpoint, 5, lambda t, i: models.Checkpoint(thread=t, run_id="r", step=i, phase="pre_llm")),
        (models.Effect, 5, lambda t, i: models.Effect(thread=t, run_id="r", step=i, tool_call_id="c")),
        (models.GraphCheckpoint, 5, lambda t, i: models.GraphCheckpoint(thread=t, step=i, payload={})),
    ]:
        model.objects.using(alias).bulk_create([of_thread(t, i) for t in made for i in range(each)])


def _rows_read(alias: str) -> dict[str, int]:
    """Rows and index entries each growing table gave this transaction's queries (PostgreSQL's statistics)."""
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_stat_get_xact_tuples_returned(c.oid) + pg_stat_get_xact_tuples_fetched(c.oid)"
            " + (SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(i.indexrelid)), 0) FROM pg_index i"
            " WHERE i.indrelid = c.oid) FROM pg_class c WHERE c.relname = ANY(%s)",
            [list(GROWING_TABLES)],
        )
        return dict(cursor.fetchall())


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_a_run_reads_the_threads_written_to_since_the_last_not_every_table(alias):
    """Each hourly run aggregated every event, checkpoint and effect of every account to find
    the few threads over budget: linear in the tables (at 100 million events, tens of seconds
    a run), though almost no thread had changed since the last run."""
    _quiet_threads(alias)
    policies = {"policy": RetentionPolicy(max_events_per_thread=40), "between": lambda: None}
    for _ in range(2):  # the first two runs check every thread
        assert maintenance.compact_threads(using=alias, **policies) == maintenance.CompactionSummary(0, 0, 0)
    busy = SyncDjangoMemoryStore(using=alias)
    busy.append_events([MemoryEvent(f"e{i}", "busy", None, "message", i, {}, []) for i in range(50)])
    sizes = {m._meta.db_table: m.objects.using(alias).count() for m in maintenance.GROWING.values()}
    connection = connections[alias]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE " + ", ".join(GROWING_TABLES))  # the planner knows the sizes, as it would
        before = _rows_read(alias)
    with CaptureQueriesContext(connection) as run:
        summary = maintenance.compact_threads(using=alias, **policies)
    assert summary == maintenance.CompactionSummary(threads=1, events_removed=10, failed=0)
    if connection.vendor == "postgresql":
        read = {table: n - before[table] for table, n in _rows_read(alias).items()}
        assert all(read[table] < sizes[table] / 10 for table in GROWING_TABLES), (read, sizes)
    else:  # SQLite counts nothing: no statement of the run scans a whole growing table
        scans = []
        for query in run.captured_queries:
            if query["sql"].startswith("SELECT") and any(table in query["sql"] for table in GROWING_TABLES):
                with connection.cursor() as cursor:
                    cursor.execute("EXPLAIN QUERY PLAN " + query["sql"])
                    plan = " / ".join(row[-1] for row in cursor.fetchall())
                if any(f"SCAN {table}" in plan for table in GROWING_TABLES):
                    scans.append((query["sql"][:120], plan))
        assert scans == []


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_every_thread_is_checked_on_a_change_of_policy_and_once_a_day(alias, monkeypatch):
    """Runs look only at threads written to since the last ones: what puts a thread over budget
    without a new row (a smaller policy, a graph checkpoint growing old) needs a full check."""
    from agentflow.checkpoint import Checkpoint

    events = [MemoryEvent(f"e{i}", "t", None, "message", i, {}, []) for i in range(8)]
    SyncDjangoMemoryStore(using=alias).append_events(events)
    saver = SyncDjangoCheckpointer(using=alias)
    for step in range(3):
        saver.put(Checkpoint(thread="g", step=step, state={}, ts=f"2026-01-01T00:00:0{step}+00:00"))
    retention = CheckpointRetention(keep_steps=1, max_age_days=7)

    def run(max_events: int) -> maintenance.CompactionSummary | None:
        policy = RetentionPolicy(max_events_per_thread=max_events)
        graphs = {"checkpoint_retention": retention}
        return maintenance.compact_threads(using=alias, policy=policy, between=lambda: None, **graphs)

    assert run(10) == maintenance.CompactionSummary(0, 0, 0)
    assert run(5) == maintenance.CompactionSummary(1, 3, 0)  # another policy: every thread is checked
    models.GraphCheckpoint.objects.using(alias).update(updated_at=timezone.now() - timedelta(days=40))
    assert run(5) == maintenance.CompactionSummary(0, 0, 0)  # grown old, not written to: not yet
    monkeypatch.setattr(maintenance, "FULL_CHECK_SECONDS", 0)  # a day has passed since the last full check
    assert run(5) == maintenance.CompactionSummary(1, 0, 0, graph_checkpoints_removed=2)
    marks, at = SyncDjangoStore(using=alias), (maintenance.MARKS_NAMESPACE, maintenance.MARKS_KEY)
    for odd in (None, {"since": 1}, {**marks.get(*at).value, "retry": 1}):
        marks.put(*at, odd)  # edited: a full check, not an error
        assert run(5) == maintenance.CompactionSummary(0, 0, 0)


@pytest.mark.django_db(databases=["postgres"], transaction=True)
@pytest.mark.parametrize("first", [False, True], ids=["a-later-run", "the-first-run"])
def test_rows_committed_after_a_run_began_are_looked_at_by_the_next_run(first):
    """Ids are handed out before commit: events numbered below the highest id one run saw, but
    committed after its selection, are above the mark of the run before it, so the next run
    still finds their thread over budget. The first run has no earlier mark: its own was the
    next run's starting point, and such events waited for the daily full check."""
    from django.db import transaction

    policy = {"policy": RetentionPolicy(max_events_per_thread=40), "between": lambda: None}
    if not first:
        assert maintenance.compact_threads(using="postgres", **policy) == maintenance.CompactionSummary(0, 0, 0)
    appended, commit = threading.Event(), threading.Event()

    def slow_writer() -> None:
        try:
            with transaction.atomic(using="postgres"):
                events = [MemoryEvent(f"e{i}", "late", None, "message", i, {}, []) for i in range(50)]
                SyncDjangoMemoryStore(using="postgres").append_events(events)
                appended.set()
                commit.wait(30)
        finally:
            connections["postgres"].close()

    writer = threading.Thread(target=slow_writer)
    writer.start()
    try:
        assert appended.wait(30)
        # A row with a higher id, committed: the next run's mark passes the uncommitted events.
        SyncDjangoMemoryStore(using="postgres").append_event(MemoryEvent("e0", "prompt", None, "message", 0, {}, []))
        assert maintenance.compact_threads(using="postgres", **policy) == maintenance.CompactionSummary(0, 0, 0)
    finally:
        commit.set()
        writer.join()
    assert maintenance.compact_threads(using="postgres", **policy) == maintenance.CompactionSummary(1, 10, 0)


def test_the_marks_name_the_policies_the_same_way_in_every_process():
    """The marks named the policies by their repr: a set of event types or phases prints in an
    order that changes with each process's hash seed, so each new worker saw another policy
    and checked every thread."""
    as_set = (RetentionPolicy(keep_event_types={"trace", "message", "tool_call"}), None, None)
    as_list = (RetentionPolicy(keep_event_types=["message", "tool_call", "trace"]), None, None)
    assert maintenance._policies_text(*as_set) == maintenance._policies_text(*as_list)
    states = StateRetentionPolicy(always_keep_phases={"paused", "pre_llm"}, keep_state_prefixes={"b", "a"})
    assert maintenance._policies_text(None, states, None) == maintenance._policies_text(
        None, StateRetentionPolicy(always_keep_phases=["pre_llm", "paused"], keep_state_prefixes=["a", "b"]), None
    )
    assert maintenance._policies_text(*as_list) != maintenance._policies_text(RetentionPolicy(), None, None)


@pytest.mark.django_db(databases=["default", "postgres"])
@both
@pytest.mark.parametrize("field", ["retry", "since"])
def test_marks_edited_to_an_id_past_a_bigint_mean_a_full_check_not_a_failing_run(alias, field):
    """SQLite refuses a number past 64 bits outright: a run read the edited marks and failed,
    before it could save new ones, every time."""
    policy = {"policy": RetentionPolicy(max_events_per_thread=40), "between": lambda: None}
    assert maintenance.compact_threads(using=alias, **policy) == maintenance.CompactionSummary(0, 0, 0)
    store, at = SyncDjangoStore(using=alias), (maintenance.MARKS_NAMESPACE, maintenance.MARKS_KEY)
    huge = [2**70] if field == "retry" else {name: 2**70 for name in maintenance.GROWING}
    store.put(*at, {**store.get(*at).value, field: huge})
    events = [MemoryEvent(f"e{i}", "busy", None, "message", i, {}, []) for i in range(50)]
    SyncDjangoMemoryStore(using=alias).append_events(events)
    assert maintenance.compact_threads(using=alias, **policy) == maintenance.CompactionSummary(1, 10, 0)


@pytest.mark.django_db(databases=["default", "postgres"])
@both
def test_a_sweep_that_lost_its_claim_stops_and_leaves_the_rest_to_the_next_run(alias, settings, monkeypatch):
    """The sweep renews its claim between batches: one that outlasted its lease went on
    beside the run that took the claim over, and beside every scheduled run after it."""
    settings.AFKMEMORY = {**settings.AFKMEMORY, "JOB_LEASE_SECONDS": 1}
    _expired_and_live(alias)
    batches = SyncDjangoStore._expired_batches

    def lapsing(self, *args, **kwargs):
        for number, deleted in enumerate(batches(self, *args, **kwargs)):
            if number == 0:  # the first batch outlasts a tenth of the lease, then the whole lease
                time.sleep(0.15)
                models.StoreItem.objects.using(alias).filter(key="sweep-store").delete()  # lapsed and swept, say
            yield deleted

    monkeypatch.setattr(SyncDjangoStore, "_expired_batches", lapsing)
    assert maintenance.sweep_store(using=alias, batch_size=3) == 3
    monkeypatch.undo()
    assert maintenance.sweep_store(using=alias, batch_size=3) == 4  # the rest
