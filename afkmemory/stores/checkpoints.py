"""agentflow's ``Checkpointer`` on the Django ORM: ``SyncDjangoCheckpointer`` and ``DjangoCheckpointer``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

from agentflow.checkpoint._serde import from_payload, to_payload
from agentflow.checkpoint.base import Checkpoint, ThreadInfo
from agentflow.errors import CheckpointConflict, CheckpointError
from django.db import connections, transaction
from django.db.models import Exists, F, OuterRef, Q, Subquery
from django.db.models.functions import Collate
from django.utils import timezone

from .. import models
from ..conf import afk_settings
from ..memory.types import MAX_ID_BYTES, MAX_INT64, MIN_INT64, check_count, check_id, check_json, check_text
from .bulk import DeleteByPk
from .concurrency import hop
from .items import check_alias, check_owner

__all__ = ["CheckpointRetention", "DjangoCheckpointer", "SyncDjangoCheckpointer"]

#: agentflow's timestamps are ISO-8601 strings (about 32 characters).
MAX_TS_LENGTH = models.MAX_TS_LENGTH


@dataclasses.dataclass(frozen=True)
class CheckpointRetention:
    """Which graph checkpoints of a thread ``SyncDjangoCheckpointer.apply_retention`` deletes.

    A checkpoint goes when it is not one of its thread's ``keep_steps`` latest steps *and*
    was last written more than ``max_age_days`` ago: both bounds, as agentflow's durable
    checkpointers' ``prune`` takes its two. A thread's latest steps stay however idle it
    is, and its recent history however long. The scheduled compaction applies
    ``AFKMEMORY["GRAPH_CHECKPOINT_RETENTION"]`` (these fields; None keeps everything).
    """

    keep_steps: int = 100
    max_age_days: float = 30

    def __post_init__(self) -> None:
        check_count(self.keep_steps, "keep_steps")
        if self.keep_steps < 1:
            raise ValueError("keep_steps must be at least 1: a thread's latest checkpoint always stays")
        age = self.max_age_days
        if isinstance(age, bool) or not isinstance(age, (int, float)) or not math.isfinite(age) or age < 0:
            raise ValueError(f"max_age_days must be a number of days >= 0, got {age!r}")

    def cutoff(self) -> Any:
        """The time before which a checkpoint last written is old enough to go."""
        now = timezone.now()
        try:
            return now - timedelta(days=self.max_age_days)
        except OverflowError:  # before the year 1: nothing is that old
            return datetime.min.replace(tzinfo=now.tzinfo)


def _check_step(step: Any, name: str = "step") -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"{name} must be an integer, got {type(step).__name__}")
    if not MIN_INT64 <= step <= MAX_INT64:
        raise ValueError(f"{name} {step} does not fit a 64-bit integer")
    return step


def _check_thread(thread: Any) -> str:
    return check_id(thread, "thread", max_bytes=MAX_ID_BYTES)


class SyncDjangoCheckpointer:
    """All of ``DjangoCheckpointer``'s logic as plain sync methods, for views and tasks.

    Checkpoints are ``GraphCheckpoint`` rows under the ``Thread`` named by
    ``Checkpoint.thread`` (the thread AFK's events and state use too), scoped to
    ``owner`` (None: threads without an owner) on database ``using``. The payload is
    agentflow's own serialization (``to_payload``), so ``get`` returns what was put.
    """

    model = models.GraphCheckpoint

    def __init__(self, *, owner: Any = None, using: str = "default") -> None:
        self.owner = check_owner(owner)
        self.using = check_alias(using)

    def _threads(self) -> models.ThreadQuerySet:
        return models.Thread.objects.using(self.using).for_owner(self.owner)

    def _checkpoints(self, thread: str) -> Any:
        return self.model.objects.using(self.using).in_thread(self.owner, thread)

    @staticmethod
    def _checkpoint(payload: dict[str, Any], revision: int) -> Checkpoint:
        return dataclasses.replace(from_payload(payload), revision=revision)

    # -- writes ------------------------------------------------------------------------------

    def put(self, cp: Checkpoint, *, if_revision: int | None = None) -> str:
        """Store ``cp``, bumping its step's revision; return ``"<thread>:<step>"``.

        With ``if_revision`` the write happens only if the stored revision equals it (0:
        nothing stored yet), else ``CheckpointConflict``. Each case is one statement
        (an ``INSERT ... ON CONFLICT`` or an ``UPDATE ... WHERE revision = n``), so two
        resumes racing for the same step cannot both win, even when neither row exists yet.
        """
        if not isinstance(cp, Checkpoint):
            raise TypeError(f"expected an agentflow Checkpoint, got {type(cp).__name__}")
        _check_thread(cp.thread)
        _check_step(cp.step, "checkpoint step")
        if if_revision is not None:  # one no row has (a negative one) is a conflict, as in agentflow
            _check_step(if_revision, "if_revision")
        if not isinstance(cp.ts, str) or len(cp.ts) > MAX_TS_LENGTH:
            raise ValueError(f"checkpoint ts must be an ISO-8601 string of at most {MAX_TS_LENGTH} characters")
        payload = to_payload(cp)
        try:
            check_json(payload, "checkpoint")
        except (TypeError, ValueError) as exc:
            # agentflow's durable checkpointers report unserializable state this way.
            raise CheckpointError(f"checkpoint state for thread {cp.thread!r} is not JSON-serializable: {exc}") from exc

        with transaction.atomic(using=self.using):
            thread = self._threads().for_write(self.owner, cp.thread)
            now = timezone.now()
            if if_revision is None or if_revision == 0:
                written = self._insert(thread.pk, cp, payload, now, bump=if_revision is None)
            else:
                rows = self.model.objects.using(self.using).filter(thread=thread, step=cp.step, revision=if_revision)
                written = rows.update(revision=F("revision") + 1, payload=payload, ts=cp.ts, updated_at=now) == 1
            if not written:
                current = self.model.objects.using(self.using).filter(thread=thread, step=cp.step)
                actual = current.values_list("revision", flat=True).first() or 0
                raise CheckpointConflict(cp.thread, cp.step, if_revision or 0, actual)
        return f"{cp.thread}:{cp.step}"

    def _insert(self, thread_pk: int, cp: Checkpoint, payload: dict[str, Any], now: Any, *, bump: bool) -> bool:
        """Insert revision 1; on an existing step bump its revision (``bump``) or write nothing.

        Return whether a row was written.
        """
        connection = connections[self.using]
        q = connection.ops.quote_name
        table = q(self.model._meta.db_table)
        if bump:
            on_conflict = (
                f"DO UPDATE SET {q('revision')} = {table}.{q('revision')} + 1, "
                f"{q('payload')} = excluded.{q('payload')}, {q('ts')} = excluded.{q('ts')}, "
                f"{q('updated_at')} = excluded.{q('updated_at')}"
            )
        else:
            on_conflict = "DO NOTHING"
        sql = (
            f"INSERT INTO {table} ({q('thread_id')}, {q('step')}, {q('revision')}, {q('payload')}, {q('ts')}, "
            f"{q('created_at')}, {q('updated_at')}) VALUES (%s, %s, 1, %s, %s, %s, %s) "
            f"ON CONFLICT ({q('thread_id')}, {q('step')}) {on_conflict} RETURNING {q('revision')}"
        )
        stamp = connection.ops.adapt_datetimefield_value(now)
        field = self.model._meta.get_field("payload")
        params = [thread_pk, cp.step, field.get_db_prep_save(payload, connection), cp.ts, stamp, stamp]
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchone() is not None

    def delete_thread(self, thread: str) -> None:
        """Remove every checkpoint of ``thread`` (its events and state, if any, stay)."""
        _check_thread(thread)
        self._checkpoints(thread).delete()

    def prune(self, thread: str, *, before_step: int | None = None, older_than: str | None = None) -> int:
        """Delete ``thread``'s checkpoints with ``step < before_step`` and ``ts < older_than``; return how many.

        With both bounds a checkpoint goes only if it matches both, as in agentflow's
        durable checkpointers (SQLite, Postgres, file, Redis; its ``MemoryCheckpointer``
        alone deletes what either matches): "older than a week, but not the last steps"
        never removes a run's latest checkpoint. ``ts`` is compared as text by code point,
        so give ``older_than`` in the format agentflow writes
        (``datetime.now(UTC).isoformat()``); checkpoints without a ``ts`` are never
        "older". Giving no bound is refused rather than guessed at (agentflow's backends
        disagree: one deletes nothing, another everything).
        """
        _check_thread(thread)
        if before_step is None and older_than is None:
            raise ValueError("prune needs before_step or older_than (or both)")
        if before_step is not None:
            _check_step(before_step, "before_step")
        if older_than is not None:
            if not isinstance(older_than, str):
                raise TypeError(f"older_than must be an ISO-8601 string, got {type(older_than).__name__}")
            check_text(older_than, "older_than")
        checkpoints = self._checkpoints(thread)
        doomed = Q(step__lt=before_step) if before_step is not None else None
        if older_than is not None:
            if connections[self.using].vendor == "postgresql":
                # ts is a plain CharField: compare under "C" so order is by code point, not locale.
                checkpoints = checkpoints.alias(ts_order=Collate("ts", "C"))
                old = Q(ts_order__lt=older_than) & ~Q(ts="")
            else:
                old = Q(ts__lt=older_than) & ~Q(ts="")
            doomed = old if doomed is None else doomed & old
        return checkpoints.filter(doomed).delete()[0]

    def apply_retention(self, thread: str, retention: CheckpointRetention) -> int:
        """Delete ``thread``'s checkpoints that ``retention`` lets go; return how many.

        In batches of ``DELETE_BATCH_SIZE`` rows, each its own statement and commit. Each
        ``DELETE`` repeats the bounds, so a step written again meanwhile (a resumed run)
        is kept, and steps written meanwhile only move the bound further on.
        """
        _check_thread(thread)
        if not isinstance(retention, CheckpointRetention):
            raise TypeError(f"expected a CheckpointRetention, got {type(retention).__name__}")
        checkpoints = self._checkpoints(thread)
        kept = retention.keep_steps
        oldest_kept = list(checkpoints.order_by("-step").values_list("step", flat=True)[kept - 1 : kept])
        if not oldest_kept:  # no more steps than it keeps
            return 0
        doomed = checkpoints.filter(step__lt=oldest_kept[0], updated_at__lt=retention.cutoff())
        delete = DeleteByPk(doomed)
        removed, size = 0, afk_settings.whole_number("DELETE_BATCH_SIZE")
        while batch := list(doomed.order_by("pk").values_list("pk", flat=True)[:size]):
            removed += delete(batch)
        return removed

    # -- reads -------------------------------------------------------------------------------

    def get(self, thread: str, step: int | None = None) -> Checkpoint | None:
        """Return the checkpoint at ``step`` (None: the latest) with its revision, or None."""
        _check_thread(thread)
        checkpoints = self._checkpoints(thread)
        if step is not None:
            checkpoints = checkpoints.filter(step=_check_step(step))
        rows = list(checkpoints.order_by("-step").values_list("payload", "revision")[:1])
        return self._checkpoint(*rows[0]) if rows else None

    def history(self, thread: str) -> list[Checkpoint]:
        """Return every checkpoint of ``thread``, by ascending step."""
        _check_thread(thread)
        rows = self._checkpoints(thread).order_by("step").values_list("payload", "revision")
        return [self._checkpoint(payload, revision) for payload, revision in rows]

    def list_threads(self, *, limit: int = 100, offset: int = 0) -> list[ThreadInfo]:
        """Summarize each thread with checkpoints from its latest one, ordered by thread id.

        Reads only the latest step's status fields, never whole payloads (a thread list
        that drags every state along grows slow with its rows).
        """
        check_count(limit, "limit")
        check_count(offset, "offset")
        if limit == 0:
            return []
        checkpoints = self.model.objects.using(self.using)
        page = list(
            self._threads()
            .filter(Exists(checkpoints.filter(thread=OuterRef("pk"))))
            .order_by("thread_id")
            .values_list("pk", "thread_id")[offset : offset + limit]
        )
        if not page:
            return []
        latest_step = checkpoints.filter(thread=OuterRef("thread")).order_by("-step").values("step")[:1]
        latest = checkpoints.filter(thread__in=[pk for pk, _ in page], step=Subquery(latest_step)).values_list(
            "thread", "step", "ts", "payload__interrupted", "payload__next"
        )
        status = {pk: (step, ts, bool(interrupted), next_nodes) for pk, step, ts, interrupted, next_nodes in latest}
        infos = []
        for pk, thread_id in page:
            if pk not in status:  # its checkpoints were deleted between the two queries
                continue
            step, ts, interrupted, next_nodes = status[pk]
            done = not next_nodes and not interrupted
            infos.append(ThreadInfo(thread=thread_id, latest_step=step, interrupted=interrupted, done=done, ts=ts))
        return infos


class DjangoCheckpointer:
    """agentflow's ``Checkpointer`` on the Django ORM (SQLite, PostgreSQL).

    Pass it to ``Graph.compile(checkpointer=...)``: the graph checkpoints each super-step
    into ``GraphCheckpoint`` and resumes from there after an interrupt or a crash. Each
    method is one ``sync_to_async`` hop into ``SyncDjangoCheckpointer``: the ORM and its
    transactions are synchronous, so a whole operation runs in one sync function
    (concurrent calls bound for one thread share a hop: ``afkmemory.stores.concurrency``).
    """

    def __init__(self, *, owner: Any = None, using: str = "default") -> None:
        self.sync = SyncDjangoCheckpointer(owner=owner, using=using)

    async def put(self, cp: Checkpoint, *, if_revision: int | None = None) -> str:
        return await hop(type(self.sync).put)(self.sync, cp, if_revision=if_revision)

    async def get(self, thread: str, step: int | None = None) -> Checkpoint | None:
        return await hop(type(self.sync).get)(self.sync, thread, step)

    async def history(self, thread: str) -> AsyncIterator[Checkpoint]:
        # Fetch every row in one hop, then yield: an ORM cursor cannot stay open across awaits.
        for cp in await hop(type(self.sync).history)(self.sync, thread):
            yield cp

    async def list_threads(self, *, limit: int = 100, offset: int = 0) -> list[ThreadInfo]:
        return await hop(type(self.sync).list_threads)(self.sync, limit=limit, offset=offset)

    async def delete_thread(self, thread: str) -> None:
        await hop(type(self.sync).delete_thread)(self.sync, thread)

    async def prune(self, thread: str, *, before_step: int | None = None, older_than: str | None = None) -> int:
        return await hop(type(self.sync).prune)(self.sync, thread, before_step=before_step, older_than=older_than)
