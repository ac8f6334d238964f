"""AFK's ``MemoryStore`` on the Django ORM: ``SyncDjangoMemoryStore`` and ``DjangoMemoryStore``."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, NamedTuple, cast

import numpy as np
from django.db import IntegrityError, connections, transaction
from django.db.models import CharField, Field, JSONField, Model, Q, QuerySet, TextField
from django.db.models.expressions import RawSQL
from django.db.models.functions import Collate

from .. import indexes, models
from ..conf import afk_settings
from ..memory.base import MemoryStore, check_limit
from ..memory.compaction import check_policy, doomed_state, retained
from ..memory.journal import (
    CheckpointKey,
    CheckpointRecord,
    EffectKey,
    EffectRecord,
    check_run_id,
    checkpoint_entries,
    checkpoint_from_value,
    effect_entry,
    effect_key,
    latest_key,
    parse_state_key,
    pointer_target,
    replayable_effect,
    run_checkpoints,
)
from ..memory.text import query_terms
from ..memory.types import (
    MAX_ID_BYTES,
    MAX_INT64,
    DuplicateEventError,
    Embedding,
    JsonValue,
    LongTermMemory,
    MemoryCapabilities,
    MemoryCompactionResult,
    MemoryEvent,
    RetentionPolicy,
    StateRetentionPolicy,
    check_count,
    check_id,
    check_min_score,
    check_prefix,
    check_replacement,
    check_state_entries,
    check_state_key,
    check_state_keys,
    check_timestamp,
    check_user_scope,
    cosine_similarities,
    now_ms,
    validate_event,
    validate_memory,
)
from . import asyncpool
from .bulk import IDS_PER_QUERY, DeleteByPk
from .concurrency import database_busy, hop, merged
from .items import check_alias, check_owner
from .prepared import PreparedQuery, argument_slots, builder, placeholder, planned_each_time, statement_connection

logger = logging.getLogger(__name__)

EVENT_FIELDS = ("event_id", "user_id", "type", "timestamp", "payload", "tags")
MEMORY_FIELDS = indexes.MEMORY_FIELDS


def _batches(items: Iterable[Any], size: int) -> Iterable[list[Any]]:
    iterator = iter(items)
    while batch := list(islice(iterator, size)):
        yield batch


@contextlib.contextmanager
def _batch_transaction(using: str) -> Iterator[None]:
    """One batch of a long delete, in a transaction of its own (in a caller's transaction, in that one).

    On SQLite outside a caller's transaction, the lock is then left free as long as the
    batch held it: SQLite's waiting writers poll for it (every 100 ms, once they have waited
    a while), and taken again at once it could keep them out for the whole job.
    """
    connection = connections[using]
    yields = connection.vendor == "sqlite" and not connection.in_atomic_block
    with transaction.atomic(using=using, savepoint=False):
        locked = time.monotonic()  # on SQLite, BEGIN IMMEDIATE has the lock
        yield
    if yields:
        time.sleep(time.monotonic() - locked)


#: How many times a prune of old runs decides again when what it would delete changed meanwhile.
PRUNE_ATTEMPTS = 5


class _StateTable(NamedTuple):
    """A table behind a thread's state keys."""

    model: type[Model]
    #: What its keys parse to (``CheckpointKey``, ``EffectKey``); None for plain keys.
    key_class: type[CheckpointKey] | type[EffectKey] | None
    #: The columns that identify a row under its thread: the key class's fields, or the key.
    columns: tuple[str, ...]
    #: The columns a write of a key that is there already rewrites.
    rewritten: tuple[str, ...]

    def key(self, parts: Sequence[Any]) -> str:
        """Return the state key of the row whose ``columns`` hold ``parts``."""
        return parts[0] if self.key_class is None else str(self.key_class(*parts))


#: Every table of a thread's state, plain keys first: the order writes, deletes and prunes take
#: their rows in (table by table, then ``_lock_order``), so that none of them wait on each
#: other in a circle.
_STATE_TABLES = (
    _StateTable(models.StateEntry, None, ("key",), ("value", "updated_at")),
    _StateTable(models.Checkpoint, CheckpointKey, ("run_id", "step", "phase"), ("value", "updated_at")),
    _StateTable(models.Effect, EffectKey, ("run_id", "step", "tool_call_id"), ("value", "input_hash")),
)
_JOURNALS = _STATE_TABLES[1:]


def _may_hold(key_class: type[CheckpointKey] | type[EffectKey], prefix: str) -> bool:
    """Whether a journal's keys (``checkpoint:...``, ``effect:...``) can start with ``prefix``."""
    return key_class.PREFIX.startswith(prefix) or prefix.startswith(key_class.PREFIX)


def _state_address(key: str, parsed: CheckpointKey | EffectKey | None = None) -> tuple[int, dict[str, Any]]:
    """Where the row behind state ``key`` is: its table's place in ``_STATE_TABLES`` and its columns there."""
    parsed = parsed or parse_state_key(key)
    for place, table in enumerate(_JOURNALS, start=1):
        if isinstance(parsed, table.key_class):  # type: ignore[arg-type]
            return place, {column: getattr(parsed, column) for column in table.columns}
    return 0, {"key": key}


def _lock_order(key: str) -> tuple[int, tuple[Any, ...]]:
    """Where the row behind state ``key`` comes when several are taken: its table's place in
    ``_STATE_TABLES``, then its columns there (``_in_lock_order`` sorts rows the same way in SQL).
    """
    place, columns = _state_address(key)
    return place, tuple(columns.values())


def _in_lock_order(rows: QuerySet, columns: Sequence[str], vendor: str) -> QuerySet:
    """``rows`` sorted as ``_lock_order`` sorts their keys: on PostgreSQL, where a locking read
    takes rows in the order it returns them, text compared byte by byte (``COLLATE "C"``, the
    order of Python's ``str``) rather than by the database's collation. SQLite locks the whole
    database, so any order does there."""
    if vendor != "postgresql":
        return rows.order_by("pk")
    text = (CharField, TextField)
    return rows.order_by(*(Collate(c, "C") if isinstance(rows.model._meta.get_field(c), text) else c for c in columns))


#: The hot reads, compiled once per database and shape (see ``prepared``).
_RECENT_EVENTS = PreparedQuery(
    lambda owner, thread_id, *, limit: models.Event.objects.in_thread(owner, thread_id)
    .newest_first()
    .values_list(*EVENT_FIELDS)[:limit]
)
_STATE_VALUE = PreparedQuery(
    lambda owner, thread_id, key: models.StateEntry.objects.in_thread(owner, thread_id)
    .filter(key=key)
    .values_list("value")[:1]
)


_EVENT_COLUMNS = [cast(Field, models.Event._meta.get_field(name)) for name in EVENT_FIELDS]


_INSERT_EVENT_SQL: dict[tuple[str, bool, int], str] = {}


def _insert_event_sql(connection: Any, *, nobody: bool, rows: int = 1) -> str:
    """``INSERT INTO event ... SELECT`` the owner's thread by name: no row if it does not exist.

    With ``rows`` > 1, one ``SELECT`` per event joined by ``UNION ALL`` (each event's
    parameters after the one before's), returning the ``event_id`` of each row written.
    """
    key = (connection.vendor, nobody, rows)
    if key not in _INSERT_EVENT_SQL:
        q = connection.ops.quote_name
        owner = f"{q('owner_id')} IS NULL" if nobody else f"{q('owner_id')} = %s"
        columns = ", ".join(q(field.column) for field in _EVENT_COLUMNS)
        select = (
            f"SELECT {q('id')}, {', '.join(['%s'] * len(_EVENT_COLUMNS))} FROM {q(models.Thread._meta.db_table)} "
            f"WHERE {owner} AND {q('thread_id')} = %s"
        )
        returning = f" RETURNING {q('event_id')}" if rows > 1 else ""
        _INSERT_EVENT_SQL[key] = (
            f"INSERT INTO {q(models.Event._meta.db_table)} ({q('thread_id')}, {columns}) "
            + " UNION ALL ".join([select] * rows)
            + returning
        )
    return _INSERT_EVENT_SQL[key]


class SyncDjangoMemoryStore:
    """All of ``DjangoMemoryStore``'s logic as plain sync methods, for views and tasks.

    ``owner`` scopes every row to one account (None: rows without an owner); ``using``
    names the database alias.
    """

    def __init__(self, *, owner: Any = None, using: str = "default") -> None:
        self.owner = check_owner(owner)
        self._owner_id = getattr(self.owner, "pk", self.owner)  # what the compiled statements compare
        self.using = check_alias(using)

    # -- threads -----------------------------------------------------------------------------

    def _threads(self) -> models.ThreadQuerySet:
        return models.Thread.objects.using(self.using).for_owner(self.owner)

    def _thread(self, thread_id: str) -> models.Thread | None:
        return self._threads().named(thread_id).first()

    def _thread_for_write(self, thread_id: str) -> models.Thread:
        # Only called inside transaction.atomic: a thread created here disappears with
        # the transaction if the write that needed it fails.
        return self._threads().for_write(self.owner, thread_id)

    def _in_thread(self, model: Any, thread_id: str) -> Any:
        return model.objects.using(self.using).in_thread(self.owner, thread_id)

    # -- events ------------------------------------------------------------------------------

    def append_event(self, event: MemoryEvent) -> None:
        """Append one event: a single ``INSERT ... SELECT`` when its thread exists.

        The statement finds the thread and inserts in one round trip, atomic on its own
        (no transaction to open and commit around it). Only a thread's first event takes
        the longer way: create the thread and insert, in one transaction.
        """
        self._append_checked(validate_event(event))

    def _append_checked(self, event: MemoryEvent) -> None:
        """``append_event`` of an event already validated."""
        # Inside a caller's transaction, a savepoint keeps a taken event id from aborting it.
        nested = connections[self.using].in_atomic_block
        try:
            with transaction.atomic(using=self.using) if nested else contextlib.nullcontext():
                inserted = self._insert_into_existing_thread(event)
            if not inserted:
                self._append_making_thread(event)
        except IntegrityError as exc:
            self._raise_if_taken(event, exc)
            if nested:
                raise
            # The thread was deleted while the statement ran (its foreign key check waited for
            # the delete): the event goes in the thread made anew, as a first event makes it.
            try:
                self._append_making_thread(event)
            except IntegrityError as again:  # another writer made it anew first, with this id
                self._raise_if_taken(event, again)
                raise

    def _raise_if_taken(self, event: MemoryEvent, error: IntegrityError) -> None:
        """Raise ``DuplicateEventError`` for ``error`` if ``event``'s id is in its thread."""
        if self._in_thread(models.Event, event.thread_id).filter(event_id=event.id).exists():
            raise DuplicateEventError(event.id, event.thread_id) from error

    def _append_making_thread(self, event: MemoryEvent) -> None:
        """Append ``event``, making its thread if there is none, in one transaction."""
        with transaction.atomic(using=self.using):
            thread = self._thread_for_write(event.thread_id)
            models.Event.objects.using(self.using).create(thread=thread, **self._event_fields(event))

    def _append_many(self, events: list[MemoryEvent]) -> list[Exception | None]:
        """Append checked events of concurrent callers (``DjangoMemoryStore``); each one's error, or None.

        In autocommit, events of distinct ids go as one statement that inserts those whose
        thread exists; the others, and all of them if it fails (a taken id), then go alone
        through ``append_event``, which creates threads and names a taken id; if SQLite was
        locked, every caller gets that instead. Inside a
        transaction each goes alone, as when the calls came one by one.
        """
        connection = connections[self.using]
        inserted: set[str] = set()
        if len(events) > 1 and len({event.id for event in events}) == len(events) and connection.get_autocommit():
            params = [value for event in events for value in self._insert_statement(event)[1]]
            sql = _insert_event_sql(connection, nobody=self._owner_id is None, rows=len(events))
            try:
                with connection.cursor() as cursor:
                    cursor.execute(sql, params)
                    inserted = {event_id for (event_id,) in cursor.fetchall()}
            except Exception as error:  # a taken id, say: nothing of it was written
                if database_busy(error):  # each append alone would wait for the lock again
                    raise
        answers: list[Exception | None] = []
        for event in events:
            try:
                if event.id not in inserted:
                    self._append_checked(event)
                answers.append(None)
            except Exception as error:
                answers.append(error)
        return answers

    def _insert_into_existing_thread(self, event: MemoryEvent) -> bool:
        """Insert ``event`` if its thread exists, in one statement; return whether it did."""
        with connections[self.using].cursor() as cursor:
            cursor.execute(*self._insert_statement(event))
            return cursor.rowcount == 1

    def _insert_statement(self, event: MemoryEvent) -> tuple[str, list[Any]]:
        """The ``INSERT ... SELECT`` of ``event`` into its thread, if the thread exists, and its parameters."""
        connection = statement_connection(self.using)  # from the event loop too (the pool)
        owner_id = self._owner_id
        # Only the JSON columns need adapting; the others are validated strings and integers
        # (preparing an integer through its field cost a tenth of the call: validators).
        params = [
            field.get_db_prep_save(value, connection) if isinstance(field, JSONField) else value
            for field, value in zip(_EVENT_COLUMNS, self._event_fields(event).values(), strict=True)
        ]
        if owner_id is not None:  # as the foreign key sends it (a UUID key is text on SQLite)
            params.append(models.Thread._meta.get_field("owner").get_db_prep_value(owner_id, connection))
        params.append(event.thread_id)
        return _insert_event_sql(connection, nobody=owner_id is None), params

    @staticmethod
    def _event_fields(event: MemoryEvent) -> dict[str, Any]:
        return {
            "event_id": event.id,
            "user_id": event.user_id,
            "type": event.type,
            "timestamp": event.timestamp,
            "payload": event.payload,
            "tags": list(event.tags),
        }

    @staticmethod
    def _event(thread_id: str, row: tuple[Any, ...]) -> MemoryEvent:
        event_id, user_id, kind, timestamp, payload, tags = row
        return MemoryEvent(event_id, thread_id, user_id, kind, timestamp, payload, tags)

    def get_recent_events(self, thread_id: str, limit: int = 50) -> list[MemoryEvent]:
        check_id(thread_id, "thread_id")
        check_limit(limit)
        return self._recent(thread_id, _RECENT_EVENTS.rows(self.using, self._owner_id, thread_id, limit=limit))

    def _recent(self, thread_id: str, rows: list[tuple[Any, ...]]) -> list[MemoryEvent]:
        return [self._event(thread_id, row) for row in reversed(rows)]

    def get_events_since(self, thread_id: str, since_ms: int, limit: int = 500) -> list[MemoryEvent]:
        check_id(thread_id, "thread_id")
        check_timestamp(since_ms, "since_ms")
        check_limit(limit)
        rows = self._in_thread(models.Event, thread_id).since(since_ms).oldest_first().values_list(*EVENT_FIELDS)
        return [self._event(thread_id, row) for row in rows[:limit]]

    def replace_thread_events(self, thread_id: str, events: list[MemoryEvent]) -> None:
        events = check_replacement(thread_id, events)
        ordered = sorted(events, key=lambda e: e.timestamp)  # stable: equal timestamps keep list order
        with transaction.atomic(using=self.using):
            thread = self._thread_for_write(thread_id)
            models.Event.objects.using(self.using).filter(thread=thread).delete()
            models.Event.objects.using(self.using).bulk_create(
                [models.Event(thread=thread, **self._event_fields(e)) for e in ordered]
            )

    def compact_thread(self, thread_id: str, policy: RetentionPolicy) -> MemoryCompactionResult:
        """Delete, by id, exactly the events the policy drops; see ``compact_thread``.

        Only ids read at decision time are deleted, so an event appended meanwhile is never
        touched (AFK's adapters delete the whole thread and re-insert a snapshot, losing
        such events). On PostgreSQL the decision and the deletes share one transaction; the
        thread row is locked ``FOR NO KEY UPDATE``: compactions of one thread run one at a
        time, while appends (which only take ``FOR KEY SHARE`` through their foreign key) go
        on. SQLite has one write lock for the whole database, which one transaction would
        hold for the whole thread, failing every other writer that waits longer than its
        ``timeout``: there the ids are read in one statement (one snapshot, in WAL mode) and
        each batch of deletes commits on its own, then leaves the lock free as long as it
        held it, letting other writers in between. An interrupted compaction has then
        removed some of what it decided to, none of what it keeps, the events beyond the
        window before the window's: the next one makes the same decision on what is left,
        and finishes the job. ``events_before`` is what this call kept plus what it removed,
        so two compactions racing on SQLite count each event once. Inside a caller's transaction it
        is one transaction on SQLite too.
        """
        check_id(thread_id, "thread_id")
        check_policy(policy, RetentionPolicy, "policy")
        batch_size = afk_settings.whole_number("DELETE_BATCH_SIZE")
        connection = connections[self.using]
        # In a caller's transaction the batches cannot commit on their own, on SQLite either.
        one_transaction = connection.vendor != "sqlite" or connection.in_atomic_block
        with transaction.atomic(using=self.using) if one_transaction else contextlib.nullcontext():
            threads = self._threads().named(thread_id)
            thread = (threads.select_for_update(no_key=True) if one_transaction else threads).first()
            if thread is None:
                return MemoryCompactionResult(0, 0, 0)
            # Every id comes from ONE statement, streamed through a cursor a page at a time:
            # one snapshot, so an event committed after the decision began is never among
            # them, whatever its timestamp. (A second SELECT for the events older than the
            # window would see a back-dated event appended in between, and delete it.)
            # Newest first along the (thread, timestamp, id) index: no sort, short fetches.
            events = models.Event.objects.using(self.using).filter(thread=thread).newest_first()
            rows = events.values_list("id", "type").iterator(chunk_size=batch_size)
            window = list(islice(rows, policy.scan_limit))
            older = [pk for pk, _ in rows]  # beyond the scan window: removed, as in AFK
            window.reverse()
            keep = retained(window, policy)
            # The events beyond the window go first: a compaction killed between two batches
            # has then left the window whole, or kept all it keeps and dropped part of the
            # rest, and the next one (whose window is then that remainder) decides the same.
            # The window's events first, and the next window would reach back past them, to
            # events this one drops, and keep old events of the protected types in place of
            # the newest others.
            doomed = older + [pk for pk, _ in window if pk not in keep]
            delete = DeleteByPk(models.Event.objects.using(self.using))
            removed = 0
            for batch in _batches(doomed, batch_size):
                with _batch_transaction(self.using):  # inside the transaction above, nothing of its own
                    removed += delete(batch)
        return MemoryCompactionResult(len(keep) + removed, len(keep), removed)

    # -- state -------------------------------------------------------------------------------

    def _state_row(self, thread: models.Thread, key: str, value: JsonValue) -> Model:
        place, columns = _state_address(key)
        model = _STATE_TABLES[place].model
        if model is models.Effect:
            input_hash = value.get("input_hash") if isinstance(value, dict) else None
            # The column is for browsing (the value holds the hash): one longer than it is left out.
            columns["input_hash"] = (
                input_hash if isinstance(input_hash, str) and len(input_hash) <= MAX_ID_BYTES else ""
            )
        return model(thread=thread, value=value, **columns)

    def put_state_many(self, thread_id: str, entries: dict[str, JsonValue]) -> None:
        check_id(thread_id, "thread_id")
        check_state_entries(entries)
        with transaction.atomic(using=self.using):
            thread = self._thread_for_write(thread_id)
            rows: dict[type[Model], dict[str, Model]] = {}
            for key, value in entries.items():
                row = self._state_row(thread, key, value)
                rows.setdefault(type(row), {})[key] = row
            for table in _STATE_TABLES:  # the order prunes lock rows in (see _lock_order)
                if table.model not in rows:
                    continue
                batch = [rows[table.model][key] for key in sorted(rows[table.model], key=_lock_order)]
                # One INSERT ... ON CONFLICT DO UPDATE: no read-then-write race between writers.
                table.model._default_manager.using(self.using).bulk_create(
                    batch,
                    update_conflicts=True,
                    unique_fields=["thread", *table.columns],
                    update_fields=list(table.rewritten),
                )

    def put_state(self, thread_id: str, key: str, value: JsonValue) -> None:
        self.put_state_many(thread_id, {key: value})

    def _state_query(self, thread_id: str, key: str, parsed: CheckpointKey | EffectKey | None = None) -> Any:
        """The rows behind state ``key``: a checkpoint, an effect, or a plain entry (``parsed``: the key, parsed)."""
        place, columns = _state_address(key, parsed)
        return self._in_thread(_STATE_TABLES[place].model, thread_id).filter(**columns)

    def get_state(self, thread_id: str, key: str) -> JsonValue | None:
        return self.lookup_state(thread_id, key)[1]

    def delete_state(self, thread_id: str, key: str) -> bool:
        """Delete ``key``; return whether this call deleted it (False: it was not there)."""
        check_id(thread_id, "thread_id")
        check_state_key(key)
        return self._state_query(thread_id, key).delete()[0] > 0

    def delete_state_many(self, thread_id: str, keys: Sequence[str]) -> None:
        check_id(thread_id, "thread_id")
        keys = check_state_keys(keys)
        with transaction.atomic(using=self.using):
            for key in sorted(set(keys), key=_lock_order):  # the order writes and prunes lock rows in
                self._state_query(thread_id, key).delete()

    def list_state(self, thread_id: str, prefix: str | None = None) -> dict[str, JsonValue]:
        check_id(thread_id, "thread_id")
        check_prefix(prefix)
        found = dict(self._in_thread(models.StateEntry, thread_id).with_prefix(prefix).values_list("key", "value"))
        for table in _JOURNALS:
            rows = self._journal_rows(table, thread_id, prefix or "")
            if rows is None:
                continue
            for *parts, value in rows.values_list(*table.columns, "value"):
                key = table.key(parts)
                if key.startswith(prefix or ""):
                    found[key] = value
        return {key: found[key] for key in sorted(found)}

    def state_page(
        self, thread_id: str, prefix: str | None = None, after: str | None = None, limit: int = 100
    ) -> tuple[dict[str, JsonValue], str | None]:
        """Return the first ``limit`` entries of ``list_state(thread_id, prefix)`` whose keys
        come after ``after``, and the key to give as ``after`` for the next page (None: no more).

        The same keys, values and order as ``list_state``, a page at a time: one statement
        that reads at most ``limit`` + 1 rows of each state table, walking its
        ``(thread, key)`` index from ``after`` (checkpoints and effects through the index on
        their key's text, ``JournalKey``), so a page costs the same deep in a long run as at
        its start. Pages are not a snapshot: a key written behind the cursor meanwhile is not
        seen, one written ahead of it is.
        """
        check_id(thread_id, "thread_id")
        check_prefix(prefix)
        if after is not None:
            check_state_key(after, "after")
        if check_limit(limit) == 0:
            raise ValueError("limit must be at least 1")
        tables = [t for t in _STATE_TABLES if t.key_class is None or _may_hold(t.key_class, prefix or "")]
        parts = [
            self._in_thread(table.model, thread_id).key_range(prefix, after).values_list("state_key", "value")
            for table in tables
        ]
        found: dict[str, JsonValue] = {}
        # Each table's first limit + 1 keys are enough: a key past them has limit + 1 before it.
        for key, value, _ in sorted(self._union_all(parts, limit + 1), key=lambda row: (row[0], row[2])):
            found[key] = value  # a key in two tables: the later table's, as list_state has it
        keys = list(found)
        if len(keys) <= limit:
            return found, None
        return {key: found[key] for key in keys[:limit]}, keys[limit - 1]

    def _union_all(self, parts: list[Any], limit: int) -> list[tuple[str, JsonValue, int]]:
        """``(state key, value, part)`` of the first ``limit`` rows of each of ``parts``, ordered
        querysets of ``(state_key, value)``, read in one statement: one snapshot, so a checkpoint
        and the latest pointer written with it are on a page together or not at all.

        Written out, as Django's ``union()`` refuses a limit in each part on SQLite.
        """
        connection = connections[self.using]
        # Each part selects (state key, value) in that order (values_list's), and every table's
        # value column is a JSONField like StateEntry.value, which decodes them all.
        compiled = [part[:limit].query.get_compiler(using=self.using).as_sql() for part in parts]
        sql = " UNION ALL ".join(f"SELECT *, {i} FROM ({part}) AS part{i}" for i, (part, _) in enumerate(compiled))
        value = cast(JSONField, models.StateEntry._meta.get_field("value"))
        column = value.get_col(models.StateEntry._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(sql, [p for _, params in compiled for p in params])
            return [(key, value.from_db_value(raw, column, connection), i) for key, raw, i in cursor.fetchall()]

    def compact_state(self, thread_id: str, policy: StateRetentionPolicy) -> tuple[int, int]:
        """Drop the checkpoints and effects of old runs (``MemoryStore.compact_state``).

        The state is read and judged without locks; then, in one transaction, only the
        doomed rows are locked ``FOR UPDATE`` (table by table, in ``_STATE_TABLES`` order)
        and read again. If one was rewritten or removed meanwhile (a resumed run moving its
        latest pointer), nothing is deleted and the prune decides again from a fresh read;
        otherwise the doomed rows go, in batches of ``DELETE_BATCH_SIZE``. Writes to the
        rows that stay never wait for it, and keys written meanwhile are not among those read.
        """
        check_id(thread_id, "thread_id")
        for _ in range(PRUNE_ATTEMPTS):
            state = self._state_rows(thread_id)
            doomed = doomed_state({key: row[2] for key, row in state.items()}, policy)
            if not doomed:
                return len(state), 0
            chosen: dict[type[Model], list[int]] = {}
            for key in sorted(doomed, key=_lock_order):
                chosen.setdefault(state[key][0], []).append(state[key][1])
            with transaction.atomic(using=self.using):
                locked = self._state_rows(thread_id, chosen)
                if all(locked.get(key) == state[key] for key in doomed):
                    size = afk_settings.whole_number("DELETE_BATCH_SIZE")
                    for model, pks in chosen.items():
                        delete = DeleteByPk(model._default_manager.using(self.using))
                        for batch in _batches(sorted(pks), size):
                            delete(batch)
                    return len(state), len(doomed)
        raise RuntimeError(f"the state of thread {thread_id!r} changed under {PRUNE_ATTEMPTS} attempts to prune it")

    def _state_rows(
        self, thread_id: str, only: dict[type[Model], list[int]] | None = None
    ) -> dict[str, tuple[Any, ...]]:
        """The thread's state rows by key: ``(table, pk, value, updated_at)``.

        With ``only`` (primary keys by table, each table's in ``_lock_order``), just those rows,
        locked ``FOR UPDATE`` (not the thread's row) in that order: call it inside a transaction.
        """
        found: dict[str, tuple[Any, ...]] = {}
        vendor = connections[self.using].vendor
        for table in _STATE_TABLES:
            model = table.model
            stamp = "updated_at" if model is not models.Effect else "created_at"  # an effect's value is its version
            rows = self._in_thread(model, thread_id)
            chunks: Iterable[Any] = [None]
            if only is not None:
                chunks = _batches(only.get(model, []), IDS_PER_QUERY)
            for chunk in chunks:
                selected = rows if chunk is None else rows.filter(pk__in=chunk).select_for_update(of=("self",))
                selected = _in_lock_order(selected, table.columns, vendor)
                for *parts, pk, value, stamped in selected.values_list(*table.columns, "pk", "value", stamp):
                    found[table.key(parts)] = (model, pk, value, stamped)
        return found

    def _journal_rows(self, table: _StateTable, thread_id: str, prefix: str) -> Any:
        """Return the rows of a journal table whose keys can start with ``prefix``, or None."""
        key_class = cast(type[CheckpointKey | EffectKey], table.key_class)
        if not _may_hold(key_class, prefix):
            return None
        head = key_class.PREFIX
        if head.startswith(prefix):
            return self._in_thread(table.model, thread_id)
        run_part = prefix[len(head) :]
        rows = self._in_thread(table.model, thread_id)
        if ":" in run_part:  # the run id is complete: an exact match
            return rows.filter(run_id=run_part.split(":", 1)[0])
        return rows.with_prefix(run_part, field="run_id")

    # -- long-term memory --------------------------------------------------------------------

    def _memories(self) -> models.MemoryQuerySet:
        return models.LongTermMemory.objects.using(self.using).for_owner(self.owner)

    @staticmethod
    def _memory(row: tuple[Any, ...]) -> LongTermMemory:
        return LongTermMemory(*row)

    def upsert_long_term_memory(self, memory: LongTermMemory, *, embedding: Embedding | None = None) -> None:
        self.save_long_term_memory(memory, embedding=embedding)

    def save_long_term_memory(self, memory: LongTermMemory, *, embedding: Embedding | None = None) -> bool:
        """``upsert_long_term_memory``, returning whether it created the memory (the API's 201 or 200)."""
        validate_memory(memory)
        fields: dict[str, Any] = {
            "user_id": memory.user_id,
            "scope": memory.scope,
            "data": memory.data,
            "text": memory.text,
            "tags": list(memory.tags),
            "metadata": memory.metadata,
            "updated_at": memory.updated_at,
        }
        if embedding is not None:
            fields["embedding"] = indexes.check_embedding(embedding, "embedding")
        # update_or_create locks the row (SELECT ... FOR UPDATE) and, when two writers
        # create the same id at once, retries the loser as an update: no duplicate.
        return self._memories().update_or_create(
            owner=self.owner,
            memory_id=memory.id,
            defaults=fields,
            create_defaults={**fields, "created_at": memory.created_at},
        )[1]

    def delete_long_term_memory(self, user_id: str | None, memory_id: str) -> None:
        check_id(user_id, "user_id", optional=True)
        check_id(memory_id, "memory_id")
        self._memories().for_user(user_id).filter(memory_id=memory_id).delete()

    def delete_long_term_memories(self, user_id: str | None, *, scope: str | None = None) -> int:
        """Delete every memory of ``user_id`` (only ``scope``'s, if given); return how many went.

        ``None`` is the memories without a user, as in the other methods. The memories go in
        batches of ``DELETE_BATCH_SIZE``, newest ``updated_at`` first: each batch reads the
        next ids through the index that starts (owner, user_id[, scope]), from where the
        previous batch stopped, and deletes them by id, in a transaction of its own (inside a
        caller's transaction, all of them in that one). So no statement's work grows with
        the user's memories (only with how many share one ``updated_at``, which the next
        batch walks past again), and an interrupted call leaves the rest for the next one. The
        DELETE repeats the user (and scope) filter: a memory moved to another user or scope
        meanwhile stays. A memory written for the user while it runs is deleted if the walk
        has not yet passed its ``updated_at``, and survives otherwise: call it again (it
        returns 0 once nothing is left) after the writers have stopped.
        """
        owned = self._owned(user_id, scope)
        size = afk_settings.whole_number("DELETE_BATCH_SIZE")
        # The order of the index the filter starts (its user_recent or user_scope index):
        # each batch starts inside it, at the last batch's updated_at, and stops at the limit.
        order = ["owner_id", "user_id", "-updated_at", "memory_id"]
        if scope is not None:
            order = ["owner_id", "user_id", "scope", "-updated_at"]
        # The ids read are this account's (a memory never changes account), and the DELETE
        # repeats the user and scope filter. Not the owner's: its join, though unused, sends
        # DeleteByPk the ORM's slower way (a Collector and a placeholder per id, every batch).
        delete = DeleteByPk(models.LongTermMemory.objects.using(self.using).for_user(user_id, scope))
        deleted = 0
        newest: int | None = None
        while True:
            with _batch_transaction(self.using):
                batch = owned if newest is None else owned.filter(updated_at__lte=newest)
                rows = list(batch.order_by(*order).values_list("pk", "updated_at")[:size])
                if rows:
                    deleted += delete([pk for pk, _ in rows])
            if len(rows) < size:
                return deleted
            newest = rows[-1][1]

    def _owned(self, user_id: str | None, scope: str | None) -> models.MemoryQuerySet:
        check_user_scope(user_id, scope)
        return self._memories().for_user(user_id, scope)

    def list_long_term_memories(
        self, user_id: str | None, *, scope: str | None = None, limit: int = 100
    ) -> list[LongTermMemory]:
        check_limit(limit)
        # Ordered by the columns the filter fixes too (no change to the order): PostgreSQL
        # takes an index's order after a column = value but not after IS NULL, and a list of
        # no user's memories, or of a store without an account, would otherwise sort them.
        fixed = ["owner_id", "user_id", *(["scope"] if scope is not None else [])]
        rows = self._owned(user_id, scope).order_by(*fixed, "-updated_at", "memory_id").values_list(*MEMORY_FIELDS)
        return [self._memory(row) for row in rows[:limit]]

    def search_long_term_memory_text(
        self, user_id: str | None, query: str, *, scope: str | None = None, limit: int = 20
    ) -> list[LongTermMemory]:
        """Return memories containing every word of ``query``, ranked by relevance.

        Both databases find the memories that contain every word, stemmed
        (``TEXT_SEARCH_CONFIG``; FTS5's porter tokenizer on SQLite), and rank each
        memory from its own words alone, never from statistics over the whole table,
        which holds every account's memories. PostgreSQL ranks with ``ts_rank_cd`` over
        the GIN-indexed text search vector (stored since migration 0008, see
        ``indexes.stored_vectors``). SQLite ranks as ``InMemoryMemoryStore``
        does, by how many times the query's words occur in the memory (newest first,
        then by id, among equals), not with FTS5's ``bm25``, whose word frequencies and
        average length span every account: there the order of one account's results
        would change with words another account wrote. The count is of the exact
        lower-cased words, so a memory found only through stemming or diacritics
        ("runs" for "run") ranks below one holding the word itself.
        """
        check_limit(limit)
        owned = self._owned(user_id, scope)
        terms = query_terms(query)
        if not terms or limit == 0:
            return []
        vendor = connections[self.using].vendor
        table = models.LongTermMemory._meta.db_table
        if vendor == "postgresql":
            ranked = owned.ranked_matching(terms)
        elif vendor == "sqlite":
            # A word's count is how many times " word " occurs in the search text with every space
            # doubled, so that adjacent words ("tea tea") do not share the space between them:
            # replace() only removes matches that do not overlap. search_text is the lower-cased
            # words one space apart (search_document) and query_terms lower-cases the terms, which
            # are parameters. It costs a few passes over the search text per term, and only for the
            # rows that match and are this owner's, user's and scope's: all in this one statement.
            spaced = f"replace(' ' || {table}.search_text || ' ', ' ', '  ')"
            count = f"(length({spaced}) - length(replace({spaced}, ' ' || %s || ' ', ''))) / (length(%s) + 2)"
            ranked = owned.matching(terms).annotate(
                rank=RawSQL("-(" + " + ".join([count] * len(terms)) + ")", [t for term in terms for t in (term, term)])
            )
        else:
            raise NotImplementedError(f"text search is not implemented for the {vendor} database")
        rows = ranked.order_by("rank", "-updated_at", "memory_id").values_list(*MEMORY_FIELDS)[:limit]
        # A rare word for a user with 200,000 memories is a GIN lookup (0.6 ms), the users
        # with a few are best read through the btree; a generic plan picks one for all (370 ms).
        with planned_each_time(self.using):
            return [self._memory(row) for row in rows]

    def search_long_term_memory_vector(
        self,
        user_id: str | None,
        query_embedding: Embedding,
        *,
        scope: str | None = None,
        limit: int = 20,
        min_score: float | None = None,
    ) -> list[tuple[LongTermMemory, float]]:
        """Return ``(memory, cosine similarity)`` pairs, most similar first.

        SQLite: an exact scan in numpy. PostgreSQL: when the user's and scope's memories
        number at most ``EXACT_SEARCH_THRESHOLD``, or are so few of the table's rows that
        the HNSW scan's budget would find too few of them (``_VectorSearchSQL.threshold``),
        an exact scan through the btree index; otherwise the HNSW index with pgvector 0.8's
        iterative scan, so a filter that matches a small share of the table still fills
        ``limit`` (filtering after a plain HNSW scan returns too few rows: the
        overfiltering pitfall). Either way one statement, one round trip.
        """
        query, floor = self._vector_args(user_id, query_embedding, scope, limit, min_score)
        if limit == 0:
            return []
        if connections[self.using].vendor == "postgresql":
            scored = self._vector_search_postgres(user_id, scope, query, limit)
        else:
            scored = self._vector_search_exact(self._owned(user_id, scope).with_embedding(), query, limit)
        return [(memory, score) for memory, score in scored if floor is None or score >= floor]

    @staticmethod
    def _vector_args(
        user_id: Any, query_embedding: Any, scope: Any, limit: Any, min_score: Any
    ) -> tuple[list[float], float | None]:
        """Check a vector search's arguments; return the query as floats and the score floor."""
        check_limit(limit)
        floor = check_min_score(min_score)
        query = indexes.check_embedding(query_embedding, "query_embedding")
        check_user_scope(user_id, scope)
        return query, floor

    def _vector_search_exact(self, owned: Any, query: list[float], limit: int) -> list[tuple[LongTermMemory, float]]:
        # A vector of another length predates a change of EMBEDDING_DIMENSIONS: it cannot
        # be compared (afkmemory_rebuild_indexes --clear-mismatched-embeddings drops them).
        candidates = [
            (pk, m, v) for pk, m, v in owned.values_list("id", "memory_id", "embedding") if len(v) == len(query)
        ]
        if not candidates:
            return []
        matrix = np.stack([vector for _, _, vector in candidates]).astype(np.float64)
        q = np.asarray(query, dtype=np.float32).astype(np.float64)
        scores = cosine_similarities(matrix, q)  # a zero vector's NaN is dropped below
        scores[~np.isfinite(scores)] = -np.inf  # a vector stored before its length was checked: last, then dropped
        # Best first; equal scores by memory id (code point order), as every backend ranks them.
        order = np.lexsort((np.array([memory_id for _, memory_id, _ in candidates]), -scores))
        best = [i for i in order[:limit] if np.isfinite(scores[i])]
        ids = [candidates[i][0] for i in best]
        rows = {row[0]: row[1:] for row in owned.filter(id__in=ids).values_list("id", *MEMORY_FIELDS)}
        return [(self._memory(rows[candidates[i][0]]), float(scores[i])) for i in best]

    def _vector_search_postgres(
        self, user_id: str | None, scope: str | None, query: list[float], limit: int
    ) -> list[tuple[LongTermMemory, float]]:
        # Each search runs one statement built once per shape (_VectorSearchSQL): building
        # the querysets, the pgvector expressions and a transaction per call cost about as
        # much as the search itself (BENCHMARKS.md, workload 3).
        sql = _VectorSearchSQL.get(self.using, self.owner, user_id is None, scope is None)
        connection = connections[self.using]
        where = sql.where_params(self.owner, user_id, scope, connection)
        params = sql.params(where, sql.literal(query), limit, _memory_table_stats(self.using))
        with connection.cursor() as cursor:
            cursor.execute(sql.search, params)
            return sql.scored(cursor.fetchall(), connection)

    # -- used by the REST API (afkmemory.api); the protocol has no such methods -------------

    def append_events(self, events: Sequence[MemoryEvent]) -> None:
        """Append ``events`` in one transaction: all of them, or none if any is invalid or taken.

        Events keep their list order among equal timestamps. An event id given twice, or
        already in its thread, is a ``ValueError`` naming it.
        """
        events = list(events)
        seen: set[tuple[str, str]] = set()
        for event in events:
            validate_event(event)
            if (event.thread_id, event.id) in seen:
                raise ValueError(f"event {event.id!r} is given twice for thread {event.thread_id!r}")
            seen.add((event.thread_id, event.id))
        if len(events) == 1:  # one statement when the thread exists (the API's usual request)
            return self._append_checked(events[0])
        if not events:
            return
        try:
            with transaction.atomic(using=self.using):
                # Found and locked against a delete (all at once, in the order deletes lock), or made.
                threads = self._threads().for_write_many(self.owner, [event.thread_id for event in events])
                rows = [models.Event(thread=threads[e.thread_id], **self._event_fields(e)) for e in events]
                models.Event.objects.using(self.using).bulk_create(rows)
        except IntegrityError as exc:
            for thread_id in dict.fromkeys(e.thread_id for e in events):
                wanted = [e.id for e in events if e.thread_id == thread_id]
                taken = self._in_thread(models.Event, thread_id).filter(event_id__in=wanted)
                first = taken.values_list("event_id", flat=True).first()
                if first is not None:
                    raise DuplicateEventError(first, thread_id) from exc
            raise

    def lookup_state(self, thread_id: str, key: str) -> tuple[bool, JsonValue | None]:
        """Return ``(True, value)`` if the thread has ``key`` (whose value may be null), else ``(False, None)``."""
        check_id(thread_id, "thread_id")
        check_state_key(key)
        parsed = parse_state_key(key)
        if parsed is None:  # a plain key: the hot case, compiled once
            return self._found(_STATE_VALUE.rows(self.using, self._owner_id, thread_id, key))
        return self._found(self._state_query(thread_id, key, parsed).values_list("value")[:1])

    @staticmethod
    def _found(rows: Iterable[tuple[Any, ...]]) -> tuple[bool, JsonValue | None]:
        for (value,) in rows:
            return True, value
        return False, None

    def write_checkpoint(
        self, thread_id: str, run_id: str, step: int, phase: str, payload: JsonValue
    ) -> CheckpointRecord:
        """Write a checkpoint of a run and move the run's latest pointer to it, in one transaction."""
        check_id(thread_id, "thread_id")
        record, entries = checkpoint_entries(thread_id, run_id, step, phase, payload, now_ms())
        self.put_state_many(thread_id, entries)
        return record

    def latest_checkpoint(self, thread_id: str, run_id: str) -> CheckpointRecord | None:
        """Return the newest checkpoint of a run, or None (``MemoryStore.latest_checkpoint``)."""
        key = pointer_target(run_id, self.get_state(thread_id, latest_key(run_id)))
        value = None if key is None else self.get_state(thread_id, str(key))
        return None if key is None or value is None else checkpoint_from_value(thread_id, key, value)

    def list_checkpoints(self, thread_id: str, run_id: str) -> list[CheckpointRecord]:
        """Return every checkpoint of a run in step order (``MemoryStore.list_checkpoints``)."""
        check_run_id(run_id)
        return run_checkpoints(thread_id, self.list_state(thread_id, f"checkpoint:{run_id}:"))

    def checkpoint_page(
        self, thread_id: str, run_id: str, after: tuple[int, str] | None = None, limit: int = 100
    ) -> tuple[list[CheckpointRecord], tuple[int, str] | None]:
        """Return the first ``limit`` checkpoints of a run after ``after`` (a ``(step, phase)``),
        by step and then phase (by code point), and the ``(step, phase)`` to give as ``after``
        for the next page (None: no more).

        A keyset over the checkpoints' unique ``(thread, run, step, phase)`` index: it reads
        at most ``limit`` + 1 rows from ``after`` on, so a page costs the same deep in a long
        run as at its start. ``list_checkpoints`` orders a step's checkpoints by write time
        instead, which no index holds.
        """
        check_id(thread_id, "thread_id")
        check_run_id(run_id)
        if check_limit(limit) == 0:
            raise ValueError("limit must be at least 1")
        rows = self._in_thread(models.Checkpoint, thread_id).filter(run_id=run_id)
        if after is not None:
            step, phase = after
            check_count(step, "after step")
            check_id(phase, "after phase")
            # step >= the cursor's bounds the index scan; the rest skips the cursor's own step's earlier phases.
            rows = rows.filter(Q(step__gt=step) | Q(phase__gt=phase), step__gte=step)
        found = list(rows.order_by("step", "phase").values_list("step", "phase", "value")[: limit + 1])
        records = [
            checkpoint_from_value(thread_id, CheckpointKey(run_id, step, phase), value)
            for step, phase, value in found[:limit]
        ]
        if len(found) <= limit:
            return records, None
        return records, (records[-1].step, records[-1].phase)

    def record_effect(
        self,
        thread_id: str,
        run_id: str,
        step: int,
        tool_call_id: str,
        *,
        input_hash: str,
        output: JsonValue,
    ) -> EffectRecord:
        """Journal a completed tool call so a resumed run can replay it (``MemoryStore.record_effect``)."""
        record, key, value = effect_entry(thread_id, run_id, step, tool_call_id, input_hash, output, now_ms())
        self.put_state(thread_id, key, value)
        return record

    def get_effect(
        self, thread_id: str, run_id: str, step: int, tool_call_id: str, *, input_hash: str
    ) -> EffectRecord | None:
        """Return the journaled tool call to replay, or None (``MemoryStore.get_effect``).

        Raise ``EffectMismatchError`` if it completed with a different input.
        """
        key = effect_key(run_id, step, tool_call_id)
        return replayable_effect(thread_id, key, self.get_state(thread_id, str(key)), input_hash)

    def search_long_term_memory_fused(
        self,
        user_id: str | None,
        *,
        query: str | None = None,
        query_embedding: Embedding | None = None,
        scope: str | None = None,
        limit: int = 20,
        min_score: float | None = None,
        k: int = 60,
    ) -> list[tuple[LongTermMemory, float, float | None]]:
        """Return ``(memory, fused score, cosine similarity or None)`` triples, best first.

        Text search (``query``) and vector search (``query_embedding``, cut at ``min_score``)
        are ranked separately and merged by reciprocal rank fusion: a memory scores
        ``sum(1 / (k + rank))`` over the lists it is in (rank from 1, ``k`` = 60 as in
        Cormack, Clarke and Buettcher, SIGIR 2009), so neither list's raw scores, which are
        not comparable, decide alone. With both, each list contributes its best ``4 * limit``
        candidates; with one, its ranking is kept as is. Ties go to the better single rank.
        Similarity is None for a memory the vector search did not return. A query of more
        than ``MAX_QUERY_TERMS`` distinct words is a ValueError without an embedding; with
        one, the embedding ranks alone (the user's whole message, as hybrid search sends it).
        """
        check_limit(limit)
        check_count(k, "k", minimum=1)
        if query is None and query_embedding is None:
            raise ValueError("give a query, a query_embedding, or both")
        if min_score is not None and query_embedding is None:
            raise ValueError("min_score applies to vector search: give a query_embedding with it")
        if query is not None:
            try:
                query_terms(query)  # refused before the vector search runs
            except ValueError:
                if query_embedding is None:
                    raise
                # Too many words for a text search (a match holds every one): the embedding ranks alone.
                query = None
        depth = min(limit * 4, MAX_INT64) if query is not None and query_embedding is not None else limit
        ranked: list[list[tuple[LongTermMemory, float | None]]] = []
        if query_embedding is not None:
            vector = self.search_long_term_memory_vector(
                user_id, query_embedding, scope=scope, limit=depth, min_score=min_score
            )
            ranked.append([(memory, similarity) for memory, similarity in vector])
        if query is not None:
            ranked.append([(memory, None) for memory in self.search_long_term_memory_text(
                user_id, query, scope=scope, limit=depth
            )])  # fmt: skip
        fused: dict[str, _Fused] = {}
        for results in ranked:
            for rank, (memory, similarity) in enumerate(results, start=1):
                entry = fused.setdefault(memory.id, _Fused(memory, best_rank=rank))
                entry.score += 1.0 / (k + rank)
                entry.similarity = similarity if similarity is not None else entry.similarity
                entry.best_rank = min(entry.best_rank, rank)
        best = sorted(fused.values(), key=lambda e: (-e.score, e.best_rank, e.memory.id))[:limit]
        return [(e.memory, e.score, e.similarity) for e in best]


@dataclass(slots=True)
class _Fused:
    """A memory's standing in a fused search: its summed reciprocal ranks so far."""

    memory: LongTermMemory
    score: float = 0.0
    similarity: float | None = None  # from the vector search, if it returned the memory
    best_rank: int = MAX_INT64


_PGVECTOR_VERSIONS: dict[str, tuple[int, ...]] = {}


def _pgvector_version(using: str) -> tuple[int, ...]:
    """Return the installed pgvector version of a database (cached per alias)."""
    if using not in _PGVECTOR_VERSIONS:
        with connections[using].cursor() as cursor:
            cursor.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
            row = cursor.fetchone()
        _PGVECTOR_VERSIONS[using] = tuple(int(p) for p in row[0].split(".")) if row else (0,)
    return _PGVECTOR_VERSIONS[using]


#: HNSW is used only where its scan budget should meet this many times ``limit`` matching
#: rows (``_VectorSearchSQL.threshold``): a margin for filters whose rows are not spread evenly
#: through the index.
HNSW_MARGIN = 4

#: Seconds what the memory table is like is reused (``_memory_table_stats``).
TABLE_ROWS_TTL = 60.0


class _TableStats(NamedTuple):
    """What a vector search's threshold reads of the memory table."""

    rows: float  #: its estimated row count, as the planner knows it (0 before the first ANALYZE)
    hnsw: bool  #: whether its HNSW index is there, valid, and built for the configured dimension


#: alias -> (when it was read, the memory table's stats).
_TABLE_ROWS: dict[str, tuple[float, _TableStats]] = {}

_TABLE_ROWS_SQL = (
    "SELECT GREATEST(c.reltuples, 0), EXISTS (SELECT FROM pg_index i WHERE i.indexrelid = to_regclass(%s)"
    " AND i.indrelid = c.oid AND i.indisvalid AND pg_get_indexdef(i.indexrelid) LIKE %s)"
    " FROM pg_class c WHERE c.oid = %s::regclass"
)


def _table_stats_params(using: str) -> list[Any]:
    return [indexes.HNSW_INDEX, f"%vector({indexes.embedding_dimensions()})%", _memory_table(using)]


def _known_table_stats(using: str) -> _TableStats | None:
    """The memory table's stats if read in the last ``TABLE_ROWS_TTL`` seconds, else None."""
    known = _TABLE_ROWS.get(using)
    return known[1] if known is not None and time.monotonic() - known[0] < TABLE_ROWS_TTL else None


def _remember_table_stats(using: str, rows: list[tuple[Any, ...]]) -> _TableStats:
    stats = _TableStats(float(rows[0][0]), bool(rows[0][1])) if rows else _TableStats(0.0, False)
    _TABLE_ROWS[using] = (time.monotonic(), stats)
    return stats


def _memory_table_stats(using: str) -> _TableStats:
    """The memory table's estimated rows and whether its HNSW index serves, read at most once a minute."""
    known = _known_table_stats(using)
    if known is None:
        with connections[using].cursor() as cursor:
            cursor.execute(_TABLE_ROWS_SQL, _table_stats_params(using))
            known = _remember_table_stats(using, cursor.fetchall())
    return known


def _memory_table(using: str) -> str:
    return builder(using).ops.quote_name(models.LongTermMemory._meta.db_table)


#: pgvector's largest ``hnsw.ef_search``.
EF_SEARCH_MAX = 1000


def _ef_search(limit: int) -> int:
    """HNSW's candidate list: ``HNSW_EF_SEARCH``, raised to the limit, up to what pgvector takes.

    With pgvector 0.8's iterative scan a limit past ``EF_SEARCH_MAX`` is still filled; before
    it, ``_VectorSearchSQL.threshold`` ranks such a search exactly (its scan budget is below
    ``HNSW_MARGIN`` x ``limit``).
    """
    return min(max(int(afk_settings.HNSW_EF_SEARCH), limit), EF_SEARCH_MAX)


class _VectorSearchSQL:
    """The statement of one shape of PostgreSQL vector search, built once and cached.

    The WHERE clauses are the querysets' own (``for_owner``, ``for_user``,
    ``with_embedding``) compiled with ``PreparedQuery``'s stand-ins (``placeholder``,
    ``argument_slots``), so the filters are spelled in one place; each call then only
    fills in parameters. Not a ``PreparedQuery`` itself: two compiled WHERE clauses are
    composed into one statement. The first owner seen stands in for every
    owner: whatever the type of the user model's key, its filter compiles the same.
    """

    _cache: dict[tuple[Any, ...], _VectorSearchSQL] = {}

    @classmethod
    def get(cls, using: str, owner: Any, userless: bool, scopeless: bool) -> _VectorSearchSQL:
        """Return the statement for this database, dimension and set of filters (built from sync code)."""
        found = cls.cached(using, owner, userless, scopeless)
        if found is None:
            found = cls._cache[cls._key(using, owner, userless, scopeless)] = cls(using, owner, userless, scopeless)
        return found

    @classmethod
    def cached(cls, using: str, owner: Any, userless: bool, scopeless: bool) -> _VectorSearchSQL | None:
        """The statement if it is built already, else None (no database access)."""
        return cls._cache.get(cls._key(using, owner, userless, scopeless))

    @staticmethod
    def _key(using: str, owner: Any, userless: bool, scopeless: bool) -> tuple[Any, ...]:
        return (using, owner is None, userless, scopeless, indexes.embedding_dimensions())

    def __init__(self, using: str, owner: Any, userless: bool, scopeless: bool) -> None:
        dims = indexes.embedding_dimensions()
        connection = connections[using]
        qn = connection.ops.quote_name
        meta = models.LongTermMemory._meta
        table = qn(meta.db_table)
        # The user id and scope as PreparedQuery's stand-ins; None is compiled in (IS NULL).
        arguments = [None if userless else placeholder(0, ""), None if scopeless else placeholder(1, "")]
        mine = models.LongTermMemory.objects.using(using).for_owner(owner).for_user(*arguments)
        where, slots = self._where(mine, using, arguments)
        embedded, embedded_slots = self._where(mine.with_embedding(), using, arguments)
        if embedded_slots != slots or slots.count("owner") != (owner is not None):
            raise AssertionError(f"unexpected parameters {embedded_slots} in the memory filters {embedded}")
        self.slots = slots
        self.owner_key: Any = meta.get_field("owner").target_field
        fields: list[Any] = [meta.get_field(name) for name in MEMORY_FIELDS]
        columns = ", ".join(f"{table}.{qn(field.column)}" for field in fields)
        # JSON columns come back as text and are decoded by their fields, as the ORM does.
        self.converters = [
            (i, field.from_db_value) for i, field in enumerate(fields) if hasattr(field, "from_db_value")
        ]
        embedding_field: Any = meta.get_field("embedding")
        embedding = f"{table}.{qn(embedding_field.column)}"
        memory_id = f"{table}.{qn(meta.get_field('memory_id').column)}"  # ranks equal distances, as every backend
        # The HNSW index is partial on this predicate; stating it lets the planner use the
        # index and keeps vectors of an older dimension out of the comparison.
        dimension = indexes.dimension_predicate(embedding)
        filters, embedded = embedded, f"{embedded} AND {dimension}"
        # The HNSW branch runs only for more candidates than the threshold, and the index is
        # its one right plan. A prepared statement's generic plan (the pool's from its sixth
        # call, a prepared alias's soon after) puts any user at a handful of rows, and would
        # read a big user's every memory through the btree and sort them: 6 ms became 130 to
        # 190 ms for a user with 200,000. There the filter's columns are written
        # `COALESCE(c, c)`, which the planner does not fold back, so no btree matches them.
        for name in ("owner", "user_id", "scope"):
            column = f"{table}.{qn(cast(Field, meta.get_field(name)).column)}"
            filters = filters.replace(column, f"COALESCE({column}, {column})")
        # Nor may the planner read the whole table instead, which it did at 1,536 dimensions
        # (the default), however large the table: there a vector is 6 KB, stored out of line
        # (TOAST), and a seq scan's cost counts the heap alone (715 pages for 50,000 memories:
        # 1,590), not the vectors it reads. The planner put the user at one row (0.5% for the
        # partial index's predicate, 0.5% again for the user: its defaults where it has no
        # statistics), so the LIMIT took the HNSW scan's whole cost (1,861), and a seq scan
        # and sort of the user's rows looked cheaper: 36 to 74 ms for a user of 5,000 of
        # 50,000 memories, where the index took 2 to 7 (at 384 dimensions the heap is 20 times
        # larger, and the index won). So the filters are one `CASE`, half the rows to the
        # planner (an opaque boolean's default), and the LIMIT a subquery, whose value the
        # planner does not know: it plans for 10% of those rows, a tenth of the scan's cost
        # (25.6 to 202 there). One without the other does not do on 5,000 memories: 10% of
        # one row is that row, and a known limit of 10 is most of the 12 the CASE leaves.
        opaque = f"CASE WHEN {filters} THEN true END AND {dimension}"
        # pgvector 0.8's iterative scan keeps walking the index until `limit` rows pass the
        # filter (or HNSW_MAX_SCAN_TUPLES were read); before 0.8 a selective filter returns
        # fewer rows than asked (overfiltering), and the threshold keeps such users exact.
        # relaxed_order, not strict_order: the scan goes on in batches of ef_search, and
        # strict_order drops every tuple a later batch finds nearer than one already passed
        # to the filter (another user's, mostly). On clustered data a first batch that lands
        # in the wrong cluster so lost the whole right one: recall 0 for such queries, and
        # below 0.95 on average (0.88 to 0.95) for 5 of 8 users of 600 to 5,000 memories
        # among 200,000 of 384 dimensions, each user's memories near its queries (relaxed:
        # 0.96 to 1.0, no slower). The rows it returns are sorted again below, so their
        # order is exact anyway.
        self.iterative = _pgvector_version(using) >= (0, 8)
        settings = ["set_config('hnsw.ef_search', %s, true)"]
        if self.iterative:
            settings.append("set_config('hnsw.iterative_scan', 'relaxed_order', true)")
            settings.append("set_config('hnsw.max_scan_tuples', %s, true)")
        # One statement, one round trip, no transaction of its own. `mine` counts the user's
        # and scope's memories, unordered, through the btree (an index-only scan), stopping
        # past the threshold; `mine.n` then gates the two branches as one-time filters, so
        # only one runs. Within the threshold: the bare column, which does not match the HNSW
        # index expression, so the candidates are read through the btree and sorted exactly.
        # Over it: `tuned` sets the HNSW scan's settings for this transaction
        # (`set_config(..., true)` is `SET LOCAL`: the statement's own implicit transaction,
        # or the caller's), and the search, lateral to it, starts only after they are set
        # (`OFFSET 0` keeps `tuned` a subquery, so `tuned.settings` is a one-time filter);
        # its `limit` rows, in the index's approximate order, are then sorted as the exact
        # ranking's are. The LEFT JOIN returns the count even when no row qualifies.
        self.search = (
            f"SELECT mine.n, hit.* FROM (SELECT COUNT(*) AS n FROM (SELECT 1 FROM {table} WHERE {where} LIMIT %s)"
            f" AS bounded) AS mine LEFT JOIN LATERAL ((SELECT {columns}, {embedding} <=> %s::vector AS distance"
            f" FROM {table} WHERE {embedded} AND mine.n <= %s ORDER BY distance, {memory_id} LIMIT %s)"
            f" UNION ALL (SELECT ranked.* FROM (SELECT {' || '.join(settings)} AS settings WHERE mine.n > %s"
            f" OFFSET 0) AS tuned CROSS JOIN LATERAL (SELECT {columns},"
            f" {indexes.embedding_sql(embedding)} <=> %s::vector AS distance FROM {table}"
            f" WHERE {opaque} AND tuned.settings IS NOT NULL ORDER BY distance LIMIT (SELECT %s::bigint)) AS ranked"
            f" ORDER BY ranked.distance, ranked.{qn(meta.get_field('memory_id').column)})) AS hit ON true"
        )
        # Nine significant digits give back every float32 exactly; one format string for the
        # whole vector is three times faster than formatting each number (pgvector's to_text).
        self.vector_format = "[" + ",".join(["%.9g"] * dims) + "]"

    @staticmethod
    def _where(queryset: Any, using: str, arguments: list[Any]) -> tuple[str, tuple[str, ...]]:
        """The queryset's WHERE clause, and what each of its parameters is: "user", "scope" or (any other) "owner"."""
        query = queryset.query
        sql, params = query.get_compiler(using).compile(query.where)
        slots = ["owner"] * len(params)
        for position, index, _ in argument_slots(sql, params, arguments):
            slots[position] = ("user", "scope")[index]
        return sql, tuple(slots)

    def where_params(self, owner: Any, user_id: str | None, scope: str | None, connection: Any) -> list[Any]:
        """Return the WHERE clause's parameters for one call."""
        values = {"user": user_id, "scope": scope}
        if owner is not None:
            # What the foreign key's lookup sends: the key, prepared by the user model's field.
            key = owner.pk if isinstance(owner, Model) else owner
            values["owner"] = self.owner_key.get_db_prep_value(key, connection)
        return [values[slot] for slot in self.slots]

    def literal(self, query: list[float]) -> str:
        """Return ``query`` as pgvector's text form, rounded to float32 as stored vectors are."""
        return self.vector_format % tuple(np.asarray(query, dtype=np.float32).tolist())

    def threshold(self, limit: int, table: _TableStats) -> int:
        """The most candidates a search ranks exactly.

        At least ``EXACT_SEARCH_THRESHOLD``, where exact ranking is as cheap as the index.
        More when the table is large for the candidates: n candidates spread through the
        index like any other rows leave HNSW's scan ``limit`` x rows / n index tuples to
        walk before its filter has passed ``limit`` of them, each costing about
        ``HNSW_TUPLE_COST`` exact rankings, and its recall falls the deeper it goes (0.82
        to 0.92 on clustered data of 384 dimensions for users of 600 to 5,000 memories
        among 200,000, where exact ranking took 2 to 13 ms and the scan 5 to 60). Up to
        sqrt(``HNSW_TUPLE_COST`` x ``limit`` x rows) candidates (5,657 of 200,000 rows for
        10 results) exact ranking is the cheaper of the two for such a filter, and exact; a
        user whose memories are near the query (as they often are) loses the scan's speed
        there, at most the cost of ranking that many (about 2 µs each), and a bigger user
        pays for counting that many (about 0.17 µs each) before its scan. More again when
        the filter is so selective that HNSW's scan (``HNSW_MAX_SCAN_TUPLES`` tuples;
        ``ef_search`` before pgvector 0.8) would expect fewer than ``HNSW_MARGIN`` x
        ``limit`` of its rows among the table's: there the index would return too few
        (overfiltering), and ranking the candidates exactly is the right answer however
        many they are. Every candidate when the table has no HNSW index to serve (dropped,
        being rebuilt, or for another dimension): the HNSW branch reads the index alone.
        """
        if not table.hnsw:
            return MAX_INT64 - 1
        table_rows = table.rows
        budget = int(afk_settings.HNSW_MAX_SCAN_TUPLES) if self.iterative else _ef_search(limit)
        selective = math.ceil(HNSW_MARGIN * limit * table_rows / max(budget, 1))
        # HNSW_TUPLE_COST (16): what the scan spends on each index tuple it hands to the
        # filter, in exact rankings of one candidate through the btree, measured for filters
        # spread through the index like any other rows: 15 µs against 2.5 µs at 384
        # dimensions, 9.6 against 0.9 at 32 (6x and 10x); doubled, because near the
        # break-even point the scan's recall is the worse answer for the same time (0.92 at
        # 384 dimensions where it passes 400 tuples, 0.83 at 1,000, where exact is 1.0).
        cheaper = math.ceil(math.sqrt(int(afk_settings.HNSW_TUPLE_COST) * limit * table_rows))
        # The statement compares a count with it (and with it + 1) as bigints.
        return min(max(int(afk_settings.EXACT_SEARCH_THRESHOLD), selective, cheaper), MAX_INT64 - 1)

    def params(self, where: list[Any], vector: Any, limit: int, table: _TableStats) -> list[Any]:
        """``search``'s parameters for one call: count, exact ranking, HNSW settings, HNSW ranking."""
        threshold = self.threshold(limit, table)
        settings = [str(_ef_search(limit))]
        if self.iterative:
            settings.append(str(int(afk_settings.HNSW_MAX_SCAN_TUPLES)))
        exact = [vector, *where, threshold, limit]
        hnsw = [*settings, threshold, vector, *where, limit]
        return [*where, threshold + 1, *exact, *hnsw]

    def scored(self, rows: list[Any], connection: Any) -> list[tuple[LongTermMemory, float]]:
        """``(memory, cosine similarity)`` of ``search``'s rows (the count, the columns, the distance)."""
        # A NaN distance (a vector stored before its float32 length was checked) has no similarity to rank.
        return [
            (LongTermMemory(*self.convert(row[1:-1], connection)), 1.0 - row[-1])
            for row in rows
            if row[1] is not None and math.isfinite(row[-1])
        ]

    def convert(self, row: Sequence[Any], connection: Any) -> tuple[Any, ...]:
        """Return a result row's memory fields as the ORM's ``values_list`` would."""
        values = list(row)
        for i, convert in self.converters:
            values[i] = convert(values[i], None, connection)
        return tuple(values)


class DjangoMemoryStore(MemoryStore):
    """AFK's ``MemoryStore`` on the Django ORM (SQLite, PostgreSQL with pgvector).

    Each method is one ``sync_to_async`` hop into ``SyncDjangoMemoryStore``: the ORM and
    its transactions are synchronous, so a whole operation runs in one sync function
    rather than paying a thread hop per query; concurrent calls bound for one thread
    share a hop, and their ``append_event``s a statement (``afkmemory.stores.concurrency``,
    ``SyncDjangoMemoryStore._append_many``). With ``async_pool=True`` (None, the
    default, follows the ``ASYNC_POOL`` setting), ``append_event`` (into an existing
    thread), ``get_recent_events``, ``get_state`` (of a plain key) and
    ``search_long_term_memory_vector`` on PostgreSQL send their statements from the event
    loop on connections of their own instead, outside Django's transactions
    (``afkmemory.stores.asyncpool``).
    """

    capabilities = MemoryCapabilities(text_search=True, vector_search=True, atomic_upsert=True, ttl=False)

    def __init__(self, *, owner: Any = None, using: str = "default", async_pool: bool | None = None) -> None:
        self.sync = SyncDjangoMemoryStore(owner=owner, using=using)
        self.async_pool = asyncpool.check_choice(using, async_pool)

    async def append_event(self, event: MemoryEvent) -> None:
        sync = self.sync
        validate_event(event)
        if asyncpool.pooled(sync.using, self.async_pool):
            try:
                inserted = await asyncpool.execute(sync.using, *sync._insert_statement(event))
            except IntegrityError:
                inserted = 0  # a taken id: the sync path below says which, or inserts if it has gone
            if inserted == 1:
                return
            # A new thread (or a taken id): create and insert in one transaction, on Django's side.
            await hop(type(sync)._append_checked)(sync, event)
            return
        await merged(("append", sync.using, sync._owner_id), sync._append_many, event)

    async def append_events(self, events: Sequence[MemoryEvent]) -> None:
        await hop(type(self.sync).append_events)(self.sync, events)

    async def get_recent_events(self, thread_id: str, limit: int = 50) -> list[MemoryEvent]:
        sync = self.sync
        if not asyncpool.pooled(sync.using, self.async_pool):
            return await hop(type(sync).get_recent_events)(sync, thread_id, limit)
        check_id(thread_id, "thread_id")
        check_limit(limit)
        rows = await asyncpool.rows(_RECENT_EVENTS, sync.using, sync._owner_id, thread_id, limit=limit)
        return sync._recent(thread_id, rows)

    async def get_events_since(self, thread_id: str, since_ms: int, limit: int = 500) -> list[MemoryEvent]:
        return await hop(type(self.sync).get_events_since)(self.sync, thread_id, since_ms, limit)

    async def replace_thread_events(self, thread_id: str, events: list[MemoryEvent]) -> None:
        await hop(type(self.sync).replace_thread_events)(self.sync, thread_id, events)

    async def compact_thread(self, thread_id: str, policy: RetentionPolicy) -> MemoryCompactionResult:
        return await hop(type(self.sync).compact_thread)(self.sync, thread_id, policy)

    async def put_state(self, thread_id: str, key: str, value: JsonValue) -> None:
        await hop(type(self.sync).put_state)(self.sync, thread_id, key, value)

    async def put_state_many(self, thread_id: str, entries: dict[str, JsonValue]) -> None:
        await hop(type(self.sync).put_state_many)(self.sync, thread_id, entries)

    async def delete_state_many(self, thread_id: str, keys: Sequence[str]) -> None:
        await hop(type(self.sync).delete_state_many)(self.sync, thread_id, keys)

    async def compact_state(self, thread_id: str, policy: StateRetentionPolicy) -> tuple[int, int]:
        return await hop(type(self.sync).compact_state)(self.sync, thread_id, policy)

    async def get_state(self, thread_id: str, key: str) -> JsonValue | None:
        sync = self.sync
        if not asyncpool.pooled(sync.using, self.async_pool) or parse_state_key(key) is not None:
            return await hop(type(sync).get_state)(sync, thread_id, key)
        check_id(thread_id, "thread_id")
        check_state_key(key)
        return sync._found(await asyncpool.rows(_STATE_VALUE, sync.using, sync._owner_id, thread_id, key))[1]

    async def lookup_state(self, thread_id: str, key: str) -> tuple[bool, JsonValue | None]:
        return await hop(type(self.sync).lookup_state)(self.sync, thread_id, key)

    async def list_state(self, thread_id: str, prefix: str | None = None) -> dict[str, JsonValue]:
        return await hop(type(self.sync).list_state)(self.sync, thread_id, prefix)

    async def state_page(
        self, thread_id: str, prefix: str | None = None, after: str | None = None, limit: int = 100
    ) -> tuple[dict[str, JsonValue], str | None]:
        return await hop(type(self.sync).state_page)(self.sync, thread_id, prefix, after, limit)

    async def delete_state(self, thread_id: str, key: str) -> None:
        await hop(type(self.sync).delete_state)(self.sync, thread_id, key)

    async def write_checkpoint(
        self, thread_id: str, run_id: str, step: int, phase: str, payload: JsonValue
    ) -> CheckpointRecord:
        return await hop(type(self.sync).write_checkpoint)(self.sync, thread_id, run_id, step, phase, payload)

    async def latest_checkpoint(self, thread_id: str, run_id: str) -> CheckpointRecord | None:
        return await hop(type(self.sync).latest_checkpoint)(self.sync, thread_id, run_id)

    async def list_checkpoints(self, thread_id: str, run_id: str) -> list[CheckpointRecord]:
        return await hop(type(self.sync).list_checkpoints)(self.sync, thread_id, run_id)

    async def checkpoint_page(
        self, thread_id: str, run_id: str, after: tuple[int, str] | None = None, limit: int = 100
    ) -> tuple[list[CheckpointRecord], tuple[int, str] | None]:
        return await hop(type(self.sync).checkpoint_page)(self.sync, thread_id, run_id, after, limit)

    async def upsert_long_term_memory(self, memory: LongTermMemory, *, embedding: Embedding | None = None) -> None:
        await hop(type(self.sync).upsert_long_term_memory)(self.sync, memory, embedding=embedding)

    async def save_long_term_memory(self, memory: LongTermMemory, *, embedding: Embedding | None = None) -> bool:
        return await hop(type(self.sync).save_long_term_memory)(self.sync, memory, embedding=embedding)

    async def delete_long_term_memory(self, user_id: str | None, memory_id: str) -> None:
        await hop(type(self.sync).delete_long_term_memory)(self.sync, user_id, memory_id)

    async def delete_long_term_memories(self, user_id: str | None, *, scope: str | None = None) -> int:
        # One hop for all the batches: each is a transaction, which async code cannot hold.
        return await hop(type(self.sync).delete_long_term_memories)(self.sync, user_id, scope=scope)

    async def list_long_term_memories(
        self, user_id: str | None, *, scope: str | None = None, limit: int = 100
    ) -> list[LongTermMemory]:
        return await hop(type(self.sync).list_long_term_memories)(self.sync, user_id, scope=scope, limit=limit)

    async def search_long_term_memory_text(
        self, user_id: str | None, query: str, *, scope: str | None = None, limit: int = 20
    ) -> list[LongTermMemory]:
        search = hop(type(self.sync).search_long_term_memory_text)
        return await search(self.sync, user_id, query, scope=scope, limit=limit)

    async def search_long_term_memory_fused(
        self,
        user_id: str | None,
        *,
        query: str | None = None,
        query_embedding: Embedding | None = None,
        scope: str | None = None,
        limit: int = 20,
        min_score: float | None = None,
        k: int = 60,
    ) -> list[tuple[LongTermMemory, float, float | None]]:
        return await hop(type(self.sync).search_long_term_memory_fused)(
            self.sync, user_id, query=query, query_embedding=query_embedding, scope=scope, limit=limit,
            min_score=min_score, k=k,
        )  # fmt: skip

    async def search_long_term_memory_vector(
        self,
        user_id: str | None,
        query_embedding: Embedding,
        *,
        scope: str | None = None,
        limit: int = 20,
        min_score: float | None = None,
    ) -> list[tuple[LongTermMemory, float]]:
        sync = self.sync
        if not asyncpool.pooled(sync.using, self.async_pool):
            return await hop(type(sync).search_long_term_memory_vector)(
                sync, user_id, query_embedding, scope=scope, limit=limit, min_score=min_score
            )
        query, floor = sync._vector_args(user_id, query_embedding, scope, limit, min_score)
        if limit == 0:
            return []
        key = (sync.using, sync.owner, user_id is None, scope is None)
        sql = _VectorSearchSQL.cached(*key) or await hop(_VectorSearchSQL.get)(*key)
        connection = builder(sync.using)  # for its operations only: nothing is sent through it
        where = sql.where_params(sync.owner, user_id, scope, connection)
        table = _known_table_stats(sync.using)
        if table is None:
            found = await asyncpool.fetch(sync.using, _TABLE_ROWS_SQL, _table_stats_params(sync.using))
            table = _remember_table_stats(sync.using, found)
        # The statement _vector_search_postgres sends, on the pool.
        params = sql.params(where, asyncpool.Vector(query), limit, table)
        rows = await asyncpool.fetch(sync.using, sql.search, params)
        return [(memory, score) for memory, score in sql.scored(rows, connection) if floor is None or score >= floor]
