"""The scheduled jobs (store sweep, thread compaction) and the claim that keeps each single-flight.

Celery tasks (``afkmemory.tasks``) and management commands call these, so cron and beat
run the same code.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from agentflow.errors import StoreConflict
from django.db import DatabaseError, InterfaceError, OperationalError, close_old_connections, connections
from django.db.models import CharField, Count, Exists, Max, Min, OuterRef, Q, Value
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Concat
from django.utils import timezone

from . import models
from .conf import afk_settings, check_afkmemory_database
from .memory.compaction import TERMINAL_PHASE, kept_limits
from .memory.journal import LATEST_SUFFIX, CheckpointKey
from .memory.types import RetentionPolicy, StateRetentionPolicy, new_id
from .querysets import StoreItemQuerySet
from .stores.bulk import IDS_PER_QUERY
from .stores.checkpoints import CheckpointRetention, SyncDjangoCheckpointer
from .stores.items import SyncDjangoStore
from .stores.memory import SyncDjangoMemoryStore

logger = logging.getLogger(__name__)

#: Where the job claims live in the store (rows without an owner).
JOB_NAMESPACE = ("afkmemory", "jobs")

#: How long a job's release of its claim keeps trying while the database cannot be reached
#: (a restart, a failover), backing off from 0.1 s to 2 s between tries.
RELEASE_RETRY_SECONDS = 10.0


class _ThisProcess:
    """Which process wrote a claim, and which of this process's claims are held by a job still running.

    ``id`` is random per process (a forked child draws its own), so a claim naming it was
    written here, and a ``Claim`` whose ``process`` is not it was taken by a parent of this
    forked child (which holds no claim of its parent's). ``live`` holds the tokens of the
    ``single_flight`` blocks under way in any thread of this process: a claim of this
    process whose token is not among them belongs to a run that ended without releasing
    it (the database was unreachable at its end).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: set[str] = set()
        self.id = new_id("process")


_this_process = _ThisProcess()


def _forked() -> None:
    """In a forked child: its own id, and none of its parent's runs (nor the lock a parent's thread held)."""
    global _this_process
    _this_process = _ThisProcess()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_forked)


def counted(number: int, noun: str) -> str:
    """Return "1 thread", "2 threads": what the jobs say is read by people, not parsed."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


@dataclass
class Claim:
    """A won ``single_flight`` claim: ``job``'s, until ``lease`` seconds after it was taken or last renewed.

    ``process`` is the ``_ThisProcess.id`` of the process that took it: only that process
    renews or releases it, never a child forked inside the block.
    """

    job: str
    token: str
    using: str
    lease: float
    process: str = field(default_factory=lambda: _this_process.id)
    renewed: float = field(default_factory=time.monotonic)

    def ours(self) -> bool:
        """Return whether this process took the claim (False in a child forked inside the block)."""
        return self.process == _this_process.id

    def keep(self, *, now: bool = False) -> bool:
        """Renew the lease once a tenth of it has passed (``now``: at once); False if the claim is no longer ours.

        A long job calls this as it goes, so a run that outlasts one lease keeps its claim
        and the next scheduled run skips instead of overlapping it; the claim of a worker
        that died still ends one lease after its last renewal. False means the lease ran out
        (and the claim was swept, or another run holds it now), or that this is a child
        forked inside the block, whose parent holds the claim: the job should stop.
        """
        if not self.ours():
            return False
        if not now and time.monotonic() - self.renewed < self.lease / 10:
            return True
        moment = timezone.now()
        mine = _claims(self.job, self.using).filter(value__token=self.token)
        if mine.update(expires_at=moment + timedelta(seconds=self.lease), updated_at=moment) != 1:
            return False
        self.renewed = time.monotonic()
        return True


def _claims(job: str, using: str) -> StoreItemQuerySet:
    return models.StoreItem.objects.using(using).for_owner(None).at(JOB_NAMESPACE, job)


@contextmanager
def single_flight(job: str, *, using: str = "default", lease: float | None = None) -> Iterator[Claim | None]:
    """Claim ``job`` across every process; yield a ``Claim`` to the one winner, None to the others.

    The claim is the store's atomic ``put(..., if_absent=True)`` with a TTL of ``lease``
    seconds (``JOB_LEASE_SECONDS``): beat started twice, or a cron line beside beat, runs
    the job once, and a worker that dies mid-job does not block it past the lease (a long
    job renews it: ``Claim.keep``). Unlike a cache lock (django-redis with
    IGNORE_EXCEPTIONS never acquires while Redis is down, silently), a database that
    cannot be reached raises.
    """
    store = SyncDjangoStore(using=using)
    token = new_id("claim")
    ttl = afk_settings.whole_number("JOB_LEASE_SECONDS") if lease is None else lease
    process = _this_process.id
    holder = {"token": token, "pid": os.getpid(), "started": _started(os.getpid()), **_process_space(),
              "process": process}  # fmt: skip
    # Live before it is written: another thread of this process must never see a claim of
    # this process, not live, before the block that wrote it even began.
    with _this_process.lock:
        _this_process.live.add(token)
    try:
        try:
            store.put(JOB_NAMESPACE, job, holder, ttl=ttl, if_absent=True)
        except StoreConflict:
            if not _taken_over(store, job, holder, ttl):
                yield None
                return
        claim = Claim(job, token, using, ttl, process)
        try:
            yield claim
        finally:
            # A child forked inside the block (os.fork(), a prefork pool) leaves its copy of
            # it too: the claim is its parent's, still running the job, to release.
            if claim.ours():
                _release(job, token, using, ttl)
    finally:
        with _this_process.lock:
            _this_process.live.discard(token)


def _process_space() -> dict[str, str | None]:
    """Where a process id names one process: this host name, boot and pid namespace (Linux).

    Hosts outside containers share one initial pid namespace, and cloned machines may
    share a name: the boot id tells machines (and boots) apart, the namespace containers
    on one machine. Elsewhere than Linux both are None, and no claim is judged by its pid.
    """
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
            "pid_namespace": _readlink("/proc/self/ns/pid")}  # fmt: skip


def _read(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return None


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot, /proc/PID/stat's 22nd field); None if gone or unknown."""
    stat = _read(f"/proc/{pid}/stat")
    return None if stat is None else stat.rsplit(")", 1)[-1].split()[19]


def _taken_over(store: SyncDjangoStore, job: str, holder: dict[str, Any], ttl: float) -> bool:
    """Take ``job``'s claim over if its holder is a process this one can see is gone, or a run of
    this process that has ended; say why a run skips.

    A run of this very process whose release failed (the database was down longer than
    ``RELEASE_RETRY_SECONDS``, see ``_release``) left its claim: when a claim names this
    process (``_ThisProcess.id``) and its token is not one of a run still under way in any
    of its threads, it is replaced at once, on any system. A holder killed mid-job
    (``kill -9``, the OOM killer, a stop past its grace period) leaves its claim until the
    lease ends. When the holder was a process of this host, boot and pid namespace
    (``_process_space``) that is no longer running (no process has its pid, or one that
    started at another time), the claim is replaced at once. Either is replaced only if it
    still holds that holder's token (another run taking it first wins). A claim of this
    host name written before claims said more, whose pid is not running, is warned about,
    with how to run the job sooner. Otherwise, DEBUG: the callers report a skipped run their
    own way (the tasks log it, the commands print it unless -v 0).
    """
    held = store.get(JOB_NAMESPACE, job)
    claim = held.value if held is not None and isinstance(held.value, dict) else {}
    pid = claim.get("pid")
    if claim.get("process") == holder["process"]:
        with _this_process.lock:
            running = claim.get("token") in _this_process.live
        if running:  # in another thread of this process (or an enclosing block of this one)
            logger.debug("job %s is already running in this process; skipped", job)
            return False
        return _replace(store, job, claim, holder, ttl, "an earlier run of this process, which could not release it")
    if claim.get("host") != holder["host"] or not isinstance(pid, int):
        logger.debug("job %s is already running elsewhere; skipped", job)
        return False
    space = ("boot_id", "pid_namespace")
    if holder["boot_id"] and holder["pid_namespace"] and all(claim.get(k) == holder[k] for k in space):
        started = _started(pid)
        if started is not None and claim.get("started") in (None, started):  # it runs (or cannot be told apart)
            logger.debug("job %s is already running in process %s; skipped", job, pid)
            return False
        gone = f"process {pid} of this host, which is not running (did it crash?)"
        return _replace(store, job, claim, holder, ttl, gone)
    if "boot_id" not in claim and not _running(pid):  # a claim of an earlier version
        logger.warning(
            "job %s is claimed by process %s of this host, which is not running (did it crash?): its runs are "
            "skipped until the claim's lease ends at %s; to run it sooner, delete the store item %s / %s "
            "(the admin's store items)",
            job, pid, held.expires_at if held else "?", "/".join(JOB_NAMESPACE), job,
        )  # fmt: skip
    else:
        logger.debug("job %s is already running elsewhere; skipped", job)
    return False


def _replace(store: SyncDjangoStore, job: str, claim: dict[str, Any], holder: dict[str, Any], ttl: float,
             who: str) -> bool:  # fmt: skip
    """Put ``holder`` in place of ``claim`` (a dead run's) if it is still there: another run taking it first wins."""
    now = timezone.now()
    mine = _claims(job, store.using).filter(value__token=claim.get("token"))
    if mine.update(value=holder, expires_at=now + timedelta(seconds=ttl), updated_at=now) == 1:
        logger.warning("job %s was claimed by %s: its claim is taken over", job, who)
        return True
    logger.debug("job %s was claimed again meanwhile; skipped", job)
    return False


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _release(job: str, token: str, using: str, lease: float) -> None:
    """Delete our own claim (after an overrun lease it may be another's now).

    The job may have ended because its connection broke (a database restart): the release
    reconnects and tries again, backing off, for up to ``RELEASE_RETRY_SECONDS`` (a
    restart takes seconds), so the next run need not wait out the lease. If it still
    cannot, it logs so, and never hides the job's own error; the next run of this process
    then takes the claim over (``_taken_over``), and runs of other processes skip until
    the lease ends. Deleting the claim by its token is safe to repeat.
    """
    claims = _claims(job, using).filter(value__token=token)
    deadline = time.monotonic() + min(RELEASE_RETRY_SECONDS, lease)
    pause = 0.1
    while True:
        try:
            claims.delete()
            return
        except (OperationalError, InterfaceError):
            connections[using].close()  # a broken connection: the next query opens a new one
            if time.monotonic() + pause > deadline:
                logger.exception(
                    "could not release the claim of job %s: this process's next run takes it over; other "
                    "processes' runs are skipped until the lease ends (%s s)", job, lease,
                )  # fmt: skip
                return
        time.sleep(pause)
        pause = min(pause * 2, 2.0)


def sweep_store(*, using: str | None = None, batch_size: int | None = None) -> int | None:
    """Delete every account's expired store items in batches; None if another sweep runs.

    On ``using``, by default ``AFKMEMORY["DATABASE_ALIAS"]``. The sweep renews its claim
    between batches, or stops if the claim's lease ran out (``Claim.keep``): a sweep that
    outlasts the lease is not joined by every scheduled run after it.
    """
    using = check_afkmemory_database(using or afk_settings.DATABASE_ALIAS)
    with single_flight("sweep-store", using=using) as claim:
        if claim is None:
            return None
        total = 0
        for deleted in SyncDjangoStore(using=using)._expired_batches(batch_size, all_owners=True):
            total += deleted
            if not claim.keep():  # the next run sweeps what is left, if anything
                logger.warning("the store sweep lost its claim (its lease ran out) after %s", counted(total, "item"))
                break
        return total


@dataclass(frozen=True)
class CompactionSummary:
    """What one scheduled compaction run did."""

    threads: int
    events_removed: int
    failed: int
    state_keys_removed: int = 0
    graph_checkpoints_removed: int = 0

    def describe(self) -> str:
        """Return what the run did: "Compacted 2 threads, removed 5 events and 3 old graph checkpoints"."""
        removed = [counted(self.events_removed, "event")]
        if self.state_keys_removed:
            keys = self.state_keys_removed
            removed.append(f"{keys} checkpoint{' or effect' if keys == 1 else 's and effects'} of old runs")
        if self.graph_checkpoints_removed:
            removed.append(counted(self.graph_checkpoints_removed, "old graph checkpoint"))
        listed = ", ".join(removed[:-1]) + f" and {removed[-1]}" if len(removed) > 1 else removed[0]
        return f"Compacted {counted(self.threads, 'thread')}, removed {listed}"


class CompactionFailed(RuntimeError):
    """A compaction run in which some threads failed (each is logged); the others were compacted."""

    def __init__(self, summary: CompactionSummary) -> None:
        failed = counted(summary.failed, "thread")
        super().__init__(f"{failed} failed to compact (see the log); {summary.threads} compacted")
        self.summary = summary


def _thread_filters(among: Collection[int] | None, field: str = "thread") -> Iterator[Q]:
    """Filters on ``field`` of the threads ``among`` (``IDS_PER_QUERY`` a filter), or one of every thread if None."""
    if among is None:
        yield Q()
        return
    pks = sorted(among)
    for start in range(0, len(pks), IDS_PER_QUERY):
        yield Q(**{f"{field}__in": pks[start : start + IDS_PER_QUERY]})


def threads_over_budget(
    policy: RetentionPolicy, *, using: str = "default", among: Collection[int] | None = None
) -> list[int]:
    """Return the primary keys of threads holding more events than the policy keeps.

    Only of the threads ``among`` (primary keys) if given: their events, through the
    (thread, timestamp) index, not the whole table.
    """
    over: list[int] = []
    for threads in _thread_filters(among):
        counts = models.Event.objects.using(using).filter(threads).values("thread").annotate(n=Count("id"))
        over += counts.filter(n__gt=policy.max_events_per_thread).values_list("thread", flat=True)
    return over


def threads_over_state_budget(
    policy: StateRetentionPolicy, *, using: str = "default", among: Collection[int] | None = None
) -> list[int]:
    """Return the primary keys of threads a state compaction would prune (of those ``among``, if given).

    Those whose checkpoints or effects span more runs than the policy keeps, with a run of
    more effects than it keeps, and, where the policy keeps fewer phases than AFK's
    defaults (every one AFK writes), with a run of more ``runtime_state`` checkpoints than
    it keeps or a checkpoint of a phase it does not keep (gone unless of its run's latest
    step: the prune decides).
    """
    over: set[int] = set()
    max_runs, max_runtime_states, max_effects = kept_limits(policy)  # what the prune keeps
    kept = {*policy.always_keep_phases, TERMINAL_PHASE}
    # A checkpoint of its run's latest step stays whatever its phase (a resumed run starts
    # there): a thread with only those would be chosen every run and pruned of nothing.
    at_latest_step = (
        models.StateEntry.objects.using(using)
        .annotate(step_text=Cast(KT("value__step"), CharField()))
        .filter(
            thread=OuterRef("thread"),
            key=Concat(Value(CheckpointKey.PREFIX), OuterRef("run_id"), Value(LATEST_SUFFIX)),
            step_text=Cast(OuterRef("step"), CharField()),
        )
    )
    distinct_runs = Count("run_id", distinct=True)
    for threads in _thread_filters(among):
        for model in (models.Checkpoint, models.Effect):
            runs = model.objects.using(using).filter(threads).values("thread").annotate(n=distinct_runs)
            over.update(runs.filter(n__gt=max_runs).values_list("thread", flat=True))
        effects = models.Effect.objects.using(using).filter(threads).values("thread", "run_id").annotate(n=Count("id"))
        over.update(effects.filter(n__gt=max_effects).values_list("thread", flat=True))
        checkpoints = models.Checkpoint.objects.using(using).filter(threads)
        if "runtime_state" not in kept:
            runtime = checkpoints.filter(phase="runtime_state").values("thread", "run_id").annotate(n=Count("id"))
            over.update(runtime.filter(n__gt=max_runtime_states).values_list("thread", flat=True))
        unkept = checkpoints.exclude(phase__in=[*kept, "runtime_state"]).exclude(Exists(at_latest_step))
        over.update(unkept.order_by().values_list("thread", flat=True).distinct())
    return sorted(over)


def threads_over_checkpoint_budget(
    retention: CheckpointRetention, *, using: str = "default", among: Collection[int] | None = None
) -> list[int]:
    """Return the primary keys of threads with graph checkpoints ``retention`` would delete (of those ``among``).

    Those with more checkpoints than it keeps, the oldest of them last written before its
    age bound (which may still be among the steps kept: the thread's own prune decides).
    """
    over: list[int] = []
    cutoff = retention.cutoff()
    for threads in _thread_filters(among):
        checkpoints = models.GraphCheckpoint.objects.using(using).filter(threads).values("thread")
        counts = checkpoints.annotate(n=Count("id"), oldest=Min("updated_at"))
        over += counts.filter(n__gt=retention.keep_steps, oldest__lt=cutoff).values_list("thread", flat=True)
    return sorted(over)


def _state_policy() -> StateRetentionPolicy | None:
    configured = afk_settings.STATE_RETENTION_POLICY
    return None if configured is None else StateRetentionPolicy(**configured)


def _checkpoint_retention() -> CheckpointRetention | None:
    configured = afk_settings.GRAPH_CHECKPOINT_RETENTION
    return None if configured is None else CheckpointRetention(**configured)


def _threads(pks: list[int], using: str) -> Iterator[models.Thread]:
    """The threads of ``pks`` with their owners, read ``IDS_PER_QUERY`` at a time."""
    threads = models.Thread.objects.using(using).select_related("owner").order_by("pk")
    for chunk in _thread_filters(pks, field="pk"):
        # A list, not .iterator(): the caller may close the connection a cursor would hold.
        yield from list(threads.filter(chunk))


#: Where compaction keeps how far its runs have looked (a store item without an owner, ``_Marks``):
#: deleting it makes the next run check every thread.
MARKS_NAMESPACE, MARKS_KEY = ("afkmemory", "compaction"), "marks"

#: How often a compaction run checks every thread, not only those written to since the runs
#: before it: what puts a thread over budget without a new row (a graph checkpoint growing
#: old, a run's latest pointer rewritten in place) waits at most this long.
FULL_CHECK_SECONDS = 24 * 3600

#: The tables whose new rows can put a thread over budget, by their name in the marks.
GROWING: dict[str, type[models.Event | models.Checkpoint | models.Effect | models.GraphCheckpoint]] = {
    "events": models.Event, "checkpoints": models.Checkpoint, "effects": models.Effect,
    "graph_checkpoints": models.GraphCheckpoint,
}  # fmt: skip


@dataclass(frozen=True)
class _Marks:
    """How far the compaction runs have looked; kept between runs in the store item ``MARKS_KEY``.

    ``seen`` holds each ``GROWING`` table's highest id as the last run began, ``since`` the
    same as the run before it began: the next run looks at the rows above ``since``, so a
    row whose transaction was still open as one run began (ids are handed out before
    commit) is looked at by the next. ``policies`` is what the runs applied (another policy
    means a full check), ``checked_at`` when a run last checked every thread (seconds since
    the epoch), ``retry`` the threads that failed in the last run.
    """

    policies: str
    since: dict[str, int]
    seen: dict[str, int]
    checked_at: float
    retry: list[int]


def _read_marks(store: SyncDjangoStore) -> _Marks | None:
    """The marks the last complete run left; None if there are none (or not in this version's form)."""
    item = store.get(MARKS_NAMESPACE, MARKS_KEY)
    try:
        marks = _Marks(**(item.value if item is not None else None))  # type: ignore[arg-type]
        ids = [*(marks.since[name] for name in GROWING), *(marks.seen[name] for name in GROWING), *marks.retry]
    except (TypeError, KeyError):  # none, or a field missing, unknown or of another type
        return None
    # Ids a bigint holds (SQLite refuses a larger number outright: every run would fail).
    valid = all(type(i) is int and -(2**63) <= i < 2**63 for i in ids) and isinstance(marks.checked_at, (int, float))
    return marks if valid else None


def _policies_text(*policies: Any) -> str:
    """The policies a run applies, as the marks keep them: the same text in every process.

    Not their ``repr``: a set of event types or phases (which the policies take) prints in
    an order that changes with each process's hash seed, and every run would have seen
    another policy, and checked every thread. Their collections are sorted: the order
    of the event types or phases kept changes nothing.
    """
    sortable = (list, tuple, set, frozenset)
    fields = [
        None
        if policy is None
        else {name: sorted(v) if isinstance(v, sortable) else v for name, v in asdict(policy).items()}
        for policy in policies
    ]
    return json.dumps(fields, sort_keys=True)


def _highest_ids(using: str) -> dict[str, int]:
    """Each growing table's highest id (0 if empty): one step down its primary key."""
    return {name: model.objects.using(using).aggregate(top=Max("id"))["top"] or 0 for name, model in GROWING.items()}


def _written_since(since: dict[str, int], using: str) -> set[int]:
    """The threads with a row above ``since`` in a growing table: ranges of their primary keys.

    Threads whose key is among those rows', not ``DISTINCT thread_id``: without statistics,
    SQLite read that out of the whole (thread, ...) index, which is ordered by thread.
    """
    threads: set[int] = set()
    for name, model in GROWING.items():
        new_rows = model.objects.using(using).filter(id__gt=since[name]).values("thread")
        written = models.Thread.objects.using(using).filter(pk__in=new_rows).order_by()
        threads.update(written.values_list("pk", flat=True))
    return threads


def compact_threads(
    *,
    using: str | None = None,
    policy: RetentionPolicy | None = None,
    state_policy: StateRetentionPolicy | None = None,
    checkpoint_retention: CheckpointRetention | None = None,
    between: Callable[[], None] = close_old_connections,
    interrupts: tuple[type[BaseException], ...] = (),
) -> CompactionSummary | None:
    """Compact every thread over budget (on ``using``, by default ``DATABASE_ALIAS``); None if another run is going.

    Threads holding more events than ``policy`` keeps (``COMPACTION_POLICY``) are
    compacted; threads whose checkpoints and effects span more runs than ``state_policy``
    keeps (``STATE_RETENTION_POLICY``) lose the old runs', and threads with graph
    checkpoints past ``checkpoint_retention`` (``GRAPH_CHECKPOINT_RETENTION``) lose those
    (checkpoint tables must not grow forever; either setting None turns its part off).
    One thread's failure is logged and the run goes on; ``between`` runs before each
    thread (``close_old_connections`` drops connections a long run has outlived), then the
    run renews its claim, or stops if the claim's lease ran out (``Claim.keep``).
    An exception of ``interrupts`` (a Celery soft time limit) ends the run instead, its
    thread's batch rolled back and the claim released.
    """
    using = check_afkmemory_database(using or afk_settings.DATABASE_ALIAS)
    afk_settings.whole_number("DELETE_BATCH_SIZE")  # a bad one stops the run before it claims
    policy = policy or RetentionPolicy(**afk_settings.COMPACTION_POLICY)
    states = state_policy or _state_policy()
    graphs = checkpoint_retention or _checkpoint_retention()
    with single_flight("compact-threads", using=using) as claim:
        if claim is None:
            return None
        done = removed = failed = pruned = graphs_pruned = 0
        # Only the threads written to since the runs before (a new row is what puts a
        # thread over budget), and those that failed: the selection reads what changed,
        # not every table. Every thread is checked when there are no marks (the first
        # run), on a change of policy, and once every FULL_CHECK_SECONDS. (A restored
        # backup restores the marks with the tables: they stay in step.)
        marks_store, now, policies = SyncDjangoStore(using=using), time.time(), _policies_text(policy, states, graphs)
        seen = _highest_ids(using)  # before the selection: rows written during it are looked at next run
        marks = _read_marks(marks_store)
        full = marks is None or marks.policies != policies or not 0 <= now - marks.checked_at < FULL_CHECK_SECONDS
        among = None if full or marks is None else _written_since(marks.since, using) | set(marks.retry)
        events_over = set(threads_over_budget(policy, using=using, among=among))
        states_over = set(threads_over_state_budget(states, using=using, among=among)) if states is not None else set()
        graphs_over = (
            set(threads_over_checkpoint_budget(graphs, using=using, among=among)) if graphs is not None else set()
        )
        failing: list[int] = []
        for thread in _threads(sorted(events_over | states_over | graphs_over), using):
            between()
            if not claim.keep():  # its lease ran out: stop; the next run goes on from here
                logger.warning("compaction stopped after %d threads: its claim's lease ran out", done + failed)
                break
            try:
                store = SyncDjangoMemoryStore(owner=thread.owner, using=using)
                if thread.pk in events_over:
                    removed += store.compact_thread(thread.thread_id, policy).events_removed
                if states is not None and thread.pk in states_over:
                    pruned += store.compact_state(thread.thread_id, states)[1]
                if graphs is not None and thread.pk in graphs_over:
                    checkpointer = SyncDjangoCheckpointer(owner=thread.owner, using=using)
                    graphs_pruned += checkpointer.apply_retention(thread.thread_id, graphs)
                done += 1
            except interrupts:
                raise
            except Exception:  # a database error, or a row the store refuses (an id edited too long)
                logger.exception("compacting thread %s (pk %s) failed; going on", thread.thread_id, thread.pk)
                failed += 1
                failing.append(thread.pk)
        else:  # every thread chosen was visited: the next run looks from here (a stopped one, as this one did)
            since = seen if marks is None else marks.seen
            # Without marks there is no earlier run's mark to look above: the next run checks
            # every thread again, which finds the rows committed late during this one.
            checked_at = now - FULL_CHECK_SECONDS if marks is None else now if full else marks.checked_at
            value = asdict(_Marks(policies, since, seen, checked_at, failing))
            try:
                # Only while the claim is ours: a run whose lease ran out during its last thread
                # would write over the marks of the run that took the claim (its failed threads).
                if claim.keep(now=True):
                    marks_store.put(MARKS_NAMESPACE, MARKS_KEY, value)
                else:
                    logger.warning("compaction lost its claim at the end: the run that took it keeps its marks")
            except DatabaseError:  # the run's work is done: the next run looks again from the older marks
                logger.exception("compaction could not save how far it looked; the next run looks again")
        return CompactionSummary(done, removed, failed, pruned, graphs_pruned)
