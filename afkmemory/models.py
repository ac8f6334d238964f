"""Threads, their events, state, checkpoints and effects; long-term memories; store items."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from .fields import EmbeddingField, KeyField
from .memory.journal import CheckpointKey, EffectKey
from .memory.text import search_document
from .memory.types import EVENT_TYPES, MAX_ID_BYTES, MAX_KEY_BYTES
from .memory.types import LongTermMemory as MemoryRecord
from .querysets import (
    EventQuerySet,
    JournalKey,
    KeyedQuerySet,
    MemoryQuerySet,
    StoreItemQuerySet,
    ThreadQuerySet,
    ThreadScopedQuerySet,
)

#: The longest checkpoint timestamp a graph checkpoint holds (agentflow writes ISO-8601, about 32 characters).
MAX_TS_LENGTH = 64
OWNER_HELP = "The account this belongs to; empty for rows written from Python without an account."


# Foreign keys get no index of their own: each table's unique constraint leads with the key
# (the owner's is partial, owner IS NOT NULL, which any owner_id = ... lookup satisfies), so
# a single-column index would only be one more index for every insert to write.


#: How many of each kind of rows (threads, memories, store items) the admin's page of what
#: deleting accounts takes lists, by account and key; it counts the rest.
LISTED_ON_DELETE_PAGE = 100


def delete_with_owner(collector: Any, field: Any, sub_objs: Any, using: str) -> None:
    """``on_delete`` of a thread's owner: its threads go in the owner's ``pre_delete`` receiver.

    That receiver (``receivers.delete_owned_threads``) deletes them inside the account's
    delete, after the writes under way to them; Django's collector lists them before, so
    a thread made in between failed the delete on its foreign key. Deleted by both, each
    thread (and record) was heard twice by a ``pre_delete``/``post_delete`` receiver of
    the project's. The admin's page of what a delete takes lists some of them
    (``list_some_on_delete_page``), but not their records.

    A migration's historical models have no receiver: there, the threads go by ``CASCADE``.
    """
    from django.contrib.admin.utils import NestedObjects

    if isinstance(collector, NestedObjects) and not thread_relations_elsewhere():
        list_some_on_delete_page(collector, field, sub_objs)
    elif isinstance(collector, NestedObjects) or sub_objs.model is not Thread:
        models.CASCADE(collector, field, sub_objs, using)


def cascade_with_owner(collector: Any, field: Any, sub_objs: Any, using: str) -> None:
    """``on_delete`` of a memory's or store item's owner: ``CASCADE``, which deletes them in one statement.

    The admin's page of what a delete takes lists some of them (``list_some_on_delete_page``).
    """
    from django.contrib.admin.utils import NestedObjects

    if isinstance(collector, NestedObjects) and not relations_to_delete(sub_objs.model):
        list_some_on_delete_page(collector, field, sub_objs)
    else:
        models.CASCADE(collector, field, sub_objs, using)


# Called with the rows as a query, not run: whether there are any is up to the function (as for SET_NULL).
delete_with_owner.lazy_sub_objs = True  # type: ignore[attr-defined]
cascade_with_owner.lazy_sub_objs = True  # type: ignore[attr-defined]


class CountedRows(set[Any]):
    """The rows of one model on an admin delete page, and ``more`` counted without being listed.

    The page's summary reads ``len`` of each model's rows: with ``more`` in it, the summary
    counts every row the delete takes.
    """

    more = 0

    def __len__(self) -> int:
        return super().__len__() + self.more


class NotListed:
    """An admin delete page's line for an account's rows past those it lists.

    Django's page shows it as ``"<verbose_name>: <str>"``, without a link, as it shows a row
    of a model it has no admin for.
    """

    def __init__(self, model: type[models.Model], n: int) -> None:
        self._meta = type("Meta", (), {"verbose_name": model._meta.verbose_name_plural})
        self.n = n

    def __str__(self) -> str:
        return f"{self.n:,} more, not listed"


def list_some_on_delete_page(collector: Any, field: Any, sub_objs: Any) -> None:
    """List the first ``LISTED_ON_DELETE_PAGE`` of accounts' rows on the admin's delete page, and count the rest.

    Django's page (``NestedObjects``) loads and lists every row a delete takes: for an
    account of 500,000 memories and 300,000 store items it took two minutes. The listed rows
    are those first by the owner's unique key (its index serves them; among several
    accounts, the first account's first), each still checked for the permission to delete
    it; the rest of each account's are one line, and in the page's summary. Their own
    relations are not listed (a thread's records).
    """
    model = sub_objs.model
    owner_key = next(c.fields for c in model._meta.constraints if getattr(c, "fields", ())[:1] == (field.name,))
    counts = dict(sub_objs.order_by().values_list(field.attname).annotate(n=models.Count("*")))
    if not counts:  # none: not in the page's summary either ("Long-term memories: 0")
        return
    # By the owner's id, not "owner": that sorts by the user model's Meta.ordering, through a join.
    listed = list(sub_objs.order_by(field.attname, *owner_key[1:])[:LISTED_ON_DELETE_PAGE])
    collector.collect(listed, source=field.remote_field.model, source_attr=field.name, collect_related=False)
    for row in listed:
        counts[getattr(row, field.attname)] -= 1
    rows = collector.model_objs[model]
    if not isinstance(rows, CountedRows):
        rows = collector.model_objs[model] = CountedRows(rows)
    for owner, more in counts.items():
        if more:
            rows.more += more
            collector.add_edge(field.remote_field.model(pk=owner), NotListed(model, more))


def _owner_field(related_name: str, on_delete: Any) -> models.ForeignKey:
    return models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=on_delete,
        null=True,
        blank=True,
        related_name=related_name,
        verbose_name="owner",
        help_text=OWNER_HELP,
        db_index=False,
    )


def _thread_field(related_name: str) -> models.ForeignKey:
    return models.ForeignKey("Thread", on_delete=models.CASCADE, related_name=related_name, db_index=False)


def _unique_per_owner(model: str, *fields: str) -> list[models.BaseConstraint]:
    """Unique ``fields`` within each owner, and among rows without one (NULLs are distinct)."""
    return [
        models.UniqueConstraint(
            fields=["owner", *fields], condition=Q(owner__isnull=False), name=f"afkmemory_{model}_owner_uniq"
        ),
        models.UniqueConstraint(fields=list(fields), condition=Q(owner__isnull=True), name=f"afkmemory_{model}_uniq"),
    ]


class Thread(models.Model):
    """A conversation: the events, state and checkpoints of one ``thread_id``."""

    owner = _owner_field("afkmemory_threads", on_delete=delete_with_owner)
    thread_id = KeyField("thread id", max_length=MAX_ID_BYTES)
    metadata = models.JSONField(default=dict, blank=True, help_text="Free-form JSON about the thread.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ThreadQuerySet.as_manager()

    class Meta:
        ordering = ["thread_id"]
        constraints = _unique_per_owner("thread", "thread_id")

    def __str__(self) -> str:
        return self.thread_id

    def delete(self, using: Any = None, keep_parents: bool = False) -> tuple[int, dict[str, int]]:
        """Delete the thread and its records once writes under way to it are done (``ThreadQuerySet.delete``)."""
        deleted = Thread.objects.using(using or self._state.db).filter(pk=self.pk).delete()
        self.pk = None  # as Model.delete leaves it
        return deleted


class Event(models.Model):
    """One event of a thread. ``id`` (insertion order) breaks ties between equal timestamps."""

    TYPE_CHOICES = [(t, t.replace("_", " ")) for t in sorted(EVENT_TYPES)]

    thread = _thread_field("events")
    event_id = KeyField("event id", max_length=MAX_ID_BYTES)
    user_id = KeyField("user id", max_length=MAX_ID_BYTES, null=True, blank=True)
    type = models.CharField(max_length=16, choices=TYPE_CHOICES)
    timestamp = models.BigIntegerField(help_text="Milliseconds since the epoch.")
    payload = models.JSONField(default=dict, blank=True)
    tags = models.JSONField(default=list, blank=True)

    objects = EventQuerySet.as_manager()

    class Meta:
        ordering = ["thread", "timestamp", "id"]
        constraints = [models.UniqueConstraint(fields=["thread", "event_id"], name="afkmemory_event_uniq")]
        indexes = [models.Index(fields=["thread", "timestamp", "id"], name="afkmemory_event_thread_time")]

    def __str__(self) -> str:
        return f"{self.type} {self.event_id}"


class StateEntry(models.Model):
    """One key of a thread's key-value state (checkpoint and effect keys live in their own tables)."""

    thread = _thread_field("state")
    key = KeyField(max_length=MAX_KEY_BYTES)
    value = models.JSONField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = KeyedQuerySet.as_manager()

    class Meta:
        verbose_name_plural = "state entries"
        ordering = ["thread", "key"]
        constraints = [models.UniqueConstraint(fields=["thread", "key"], name="afkmemory_stateentry_uniq")]

    def __str__(self) -> str:
        return self.key


#: A checkpoint's and an effect's state key as SQL (see ``JournalKey``).
CHECKPOINT_KEY = JournalKey(CheckpointKey.PREFIX, "phase")
EFFECT_KEY = JournalKey(EffectKey.PREFIX, "tool_call_id")


class Checkpoint(models.Model):
    """A run's checkpoint at a step boundary, readable as state key ``checkpoint:<run>:<step>:<phase>``."""

    thread = _thread_field("checkpoints")
    run_id = KeyField("run id", max_length=MAX_ID_BYTES)
    step = models.BigIntegerField()
    phase = KeyField(max_length=MAX_ID_BYTES, help_text="e.g. pre_llm, post_tool_batch, step_end.")
    value = models.JSONField(null=True, blank=True, help_text="The state value stored under the key.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = KeyedQuerySet.as_manager()

    #: Its state key in SQL, which the (thread, key) index holds: pages of the state walk it.
    STATE_KEY = CHECKPOINT_KEY

    class Meta:
        ordering = ["thread", "run_id", "step", "phase"]
        constraints = [
            models.UniqueConstraint(fields=["thread", "run_id", "step", "phase"], name="afkmemory_checkpoint_uniq")
        ]
        indexes = [models.Index(models.F("thread"), CHECKPOINT_KEY, name="afkmemory_checkpoint_key")]

    def __str__(self) -> str:
        return str(CheckpointKey(self.run_id, self.step, self.phase))


class Effect(models.Model):
    """A completed tool call of a run, readable as state key ``effect:<run>:<step>:<call>``."""

    thread = _thread_field("effects")
    run_id = KeyField("run id", max_length=MAX_ID_BYTES)
    step = models.BigIntegerField()
    tool_call_id = KeyField("tool call id", max_length=MAX_KEY_BYTES)
    input_hash = models.CharField(max_length=MAX_ID_BYTES, blank=True, help_text="Hash of the tool input.")
    value = models.JSONField(null=True, blank=True, help_text="The state value stored under the key.")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = KeyedQuerySet.as_manager()

    #: Its state key in SQL, which the (thread, key) index holds: pages of the state walk it.
    STATE_KEY = EFFECT_KEY

    class Meta:
        ordering = ["thread", "run_id", "step", "tool_call_id"]
        constraints = [
            models.UniqueConstraint(fields=["thread", "run_id", "step", "tool_call_id"], name="afkmemory_effect_uniq")
        ]
        indexes = [models.Index(models.F("thread"), EFFECT_KEY, name="afkmemory_effect_key")]

    def __str__(self) -> str:
        return str(EffectKey(self.run_id, self.step, self.tool_call_id))


class GraphCheckpoint(models.Model):
    """An agentflow graph checkpoint: one super-step of a thread, with a write revision."""

    thread = _thread_field("graph_checkpoints")
    step = models.BigIntegerField()
    revision = models.PositiveIntegerField(default=1, help_text="How many times this step was written.")
    payload = models.JSONField(help_text="agentflow's checkpoint payload.")
    ts = models.CharField(max_length=MAX_TS_LENGTH, blank=True, help_text="agentflow's ISO-8601 timestamp.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ThreadScopedQuerySet.as_manager()

    class Meta:
        ordering = ["thread", "step"]
        constraints = [models.UniqueConstraint(fields=["thread", "step"], name="afkmemory_graphcheckpoint_uniq")]

    def __str__(self) -> str:
        return f"{self.thread} step {self.step}"


class LongTermMemory(models.Model):
    """A durable memory of a user, found by listing, full-text or vector search."""

    owner = _owner_field("afkmemory_memories", on_delete=cascade_with_owner)
    memory_id = KeyField("memory id", max_length=MAX_ID_BYTES)
    user_id = KeyField("user id", max_length=MAX_ID_BYTES, null=True, blank=True)
    scope = KeyField(max_length=MAX_ID_BYTES, default="global")
    data = models.JSONField(default=dict, blank=True)
    text = models.TextField(null=True, blank=True)  # noqa: DJ001  (AFK tells None from "")
    tags = models.JSONField(default=list, blank=True)
    metadata = models.JSONField(default=dict, blank=True)
    created_at = models.BigIntegerField(help_text="Milliseconds since the epoch.")
    updated_at = models.BigIntegerField(help_text="Milliseconds since the epoch.")
    embedding = EmbeddingField(null=True, blank=True, editable=False)
    search_text = models.TextField(blank=True, editable=False, help_text="What text search indexes.")

    objects = MemoryQuerySet.as_manager()

    class Meta:
        verbose_name = "long-term memory"
        verbose_name_plural = "long-term memories"
        ordering = ["-updated_at", "memory_id"]
        constraints = _unique_per_owner("memory", "memory_id")
        indexes = [
            # A user's memories in one scope: the list and vector search (the count, the exact
            # ranking) with a scope. Without it they walk all of the user's memories of every scope.
            models.Index(fields=["owner", "user_id", "scope", "-updated_at"], name="afkmemory_memory_user_scope"),
            # A user's list (every scope, newest first, a page at a time): one plan that stops at
            # the limit for every user, prepared or not. Without it a big user's memories were
            # read and sorted whenever the plan had been made for a small one.
            models.Index(fields=["owner", "user_id", "-updated_at", "memory_id"], name="afkmemory_memory_user_recent"),
            # The REST API's list (every user_id, newest first, a page at a time): without it,
            # a seq scan and a sort of all the owner's memories on every page.
            models.Index(fields=["owner", "-updated_at", "memory_id"], name="afkmemory_memory_owner_recent"),
            # On PostgreSQL, migration 0011 also builds a GIN index on tags (afkmemory_memory_tags,
            # jsonb_path_ops), which the tag filter uses. Not declared here: SQLite has no GIN, and
            # SQLite's rebuilds of the table for a later schema change would create it from here.
        ]

    def __str__(self) -> str:
        return self.memory_id

    def save(self, *args: Any, **kwargs: Any) -> None:
        # search_text is derived, so an edit from the admin or a store stays searchable.
        self.search_text = search_document(self.as_record())
        if kwargs.get("update_fields") is not None:
            kwargs["update_fields"] = {*kwargs["update_fields"], "search_text"}
        super().save(*args, **kwargs)

    def as_record(self) -> MemoryRecord:
        """Return this row as the protocol's ``LongTermMemory`` record."""
        return MemoryRecord(
            self.memory_id, self.user_id, self.scope, self.data, self.text, list(self.tags), self.metadata,
            self.created_at, self.updated_at,
        )  # fmt: skip


class StoreItem(models.Model):
    """A value under ``(namespace, key)`` in the cross-thread store, with an optional expiry."""

    # No index of its own: the unique (owner, namespace, key) index already serves lookups by
    # owner (and the cascade on user deletion), and without statistics SQLite's planner
    # preferred an owner_id index for "owner_id IS NULL", scanning every ownerless item and
    # sorting instead of walking the (namespace, key) range (tests/test_store_indexes.py).
    owner = _owner_field("afkmemory_store_items", on_delete=cascade_with_owner)
    namespace = KeyField(max_length=MAX_KEY_BYTES, help_text="Encoded namespace tuple (see afkmemory.namespaces).")
    key = KeyField(max_length=MAX_KEY_BYTES)
    value = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Gone after this time; empty: never.")

    objects = StoreItemQuerySet.as_manager()

    class Meta:
        ordering = ["namespace", "key"]
        constraints = _unique_per_owner("storeitem", "namespace", "key")
        indexes = [
            models.Index(
                fields=["expires_at"], condition=Q(expires_at__isnull=False), name="afkmemory_storeitem_expiry"
            ),
        ]

    def __str__(self) -> str:
        return self.key

    def is_live(self, now: Any = None) -> bool:
        """Whether the item has not expired (the rule ``StoreItemQuerySet.live`` filters by)."""
        return self.expires_at is None or self.expires_at > (now or timezone.now())


#: The tables of a thread's records: a thread's delete takes them with it.
THREAD_RECORDS = (Event, StateEntry, Checkpoint, Effect, GraphCheckpoint)


def thread_relations_elsewhere() -> list[Any]:
    """Relations to ``Thread`` from models other than its records (a project's own).

    The admin's delete pages count a thread's records instead of listing them; rows of such
    a model are listed and checked (a ``PROTECT`` among them) the way Django does.
    """
    return [rel for rel in relations_to_delete(Thread) if rel.related_model not in THREAD_RECORDS]


def relations_to_delete(model: type[models.Model]) -> list[Any]:
    """The relations whose rows a delete of ``model`` takes or is stopped by, as Django's collector finds them.

    Hidden ones (``related_name="+"``) included: ``_meta.related_objects`` leaves them out.
    """
    from django.db.models.deletion import get_candidate_relations_to_delete

    return list(get_candidate_relations_to_delete(model._meta))
