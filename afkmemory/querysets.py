"""Query logic of afkmemory's models; stores, views, admin and tasks call these."""

from __future__ import annotations

import functools
import json
import operator
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Self

from django.db import connections, models, transaction
from django.db.models import Q, Subquery
from django.db.models.expressions import RawSQL
from django.utils import timezone

from . import indexes
from .namespaces import encode, encode_prefix

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

    Owner = AbstractBaseUser | int | None


def prefix_bounds(prefix: str) -> tuple[str, str | None]:
    """Return ``(low, high)`` so that ``low <= s < high`` exactly when ``s`` starts with prefix.

    Comparisons are by code point (``KeyField`` columns), so a prefix is a plain btree
    range: no LIKE, no wildcards to escape, no case folding. ``high`` is None when no
    string is above every extension of the prefix (all code points at the maximum).
    """
    chars = list(prefix)
    while chars:
        last = ord(chars.pop())
        if last < sys.maxunicode:
            nxt = last + 1
            if 0xD800 <= nxt <= 0xDFFF:  # surrogates cannot be stored; skip past them
                nxt = 0xE000
            return prefix, "".join(chars) + chr(nxt)
    return prefix, None


def namespace_range(encoded_prefix: str) -> tuple[str | None, str | None]:
    """Return the ``[low, high)`` bounds of the namespaces under an encoded prefix ("": no bounds).

    An encoded prefix ends with "\x01", so ``high`` always exists (it ends with "\x02").
    """
    return prefix_bounds(encoded_prefix) if encoded_prefix else (None, None)


def owner_q(owner: Owner, field: str = "owner") -> Q:
    """Return the filter for rows of ``owner`` (None: rows without an owner)."""
    if owner is None:
        return Q(**{f"{field}__isnull": True})
    return Q(**{field: owner})


class OwnedQuerySet(models.QuerySet):
    """Rows that belong to an account (``owner``), or to nobody when used from Python."""

    def for_owner(self, owner: Owner) -> Self:
        return self.filter(owner_q(owner))


class ThreadQuerySet(OwnedQuerySet):
    def named(self, thread_id: str) -> ThreadQuerySet:
        return self.filter(thread_id=thread_id)

    def after(self, thread_id: str) -> ThreadQuerySet:
        """Threads after ``thread_id`` in id order (code points): a keyset cursor on the (owner, thread_id) index."""
        return self.filter(thread_id__gt=thread_id)

    def for_write(self, owner: Owner, thread_id: str) -> Any:
        """The owner's thread ``thread_id``, created if absent, kept from deletion until the transaction ends.

        Call inside ``transaction.atomic``. Without the lock, a thread deleted by another
        process (the API's ``DELETE threads/{id}/``, the admin) between this read and the
        rows written under it failed the write at commit with a foreign key error. On
        PostgreSQL the row is locked ``FOR KEY SHARE``, which only a delete waits for (not
        appends, not a compaction); one deleted meanwhile is made again. SQLite has one
        writer at a time: nothing can delete it before this transaction ends.
        """
        return self.for_write_many(owner, [thread_id])[thread_id]

    def for_write_many(self, owner: Owner, thread_ids: Iterable[str]) -> dict[str, Any]:
        """``for_write`` for several threads, by id: the existing ones locked in one statement.

        They are locked in primary key order, the order ``delete`` locks threads in, so a
        write to several threads and a delete of several never wait on each other in a
        circle; the missing ones are made after, in the order of their ids.
        """
        wanted = sorted(set(thread_ids))
        connection = connections[self.db]
        owner_id = getattr(owner, "pk", owner)  # the owner may be given as a user or as its primary key
        if connection.vendor != "postgresql":
            return {thread_id: self.get_or_create(owner_id=owner_id, thread_id=thread_id)[0] for thread_id in wanted}
        # The usual case, existing threads, is one statement that finds and locks them; the
        # Threads returned then carry their key, owner and id (what rows written under them need).
        query = self.filter(thread_id__in=wanted).order_by("pk").values_list("pk", "thread_id").query
        sql, params = query.get_compiler(using=self.db).as_sql()
        with connection.cursor() as cursor:
            cursor.execute(f"{sql} FOR KEY SHARE", params)
            threads = {thread_id: self.model(pk=pk, owner_id=owner_id, thread_id=thread_id) for pk, thread_id in cursor}
        for thread_id in wanted:
            if thread_id not in threads:
                threads[thread_id] = self._made_for_write(owner_id, thread_id)
        return threads

    def _made_for_write(self, owner_id: Any, thread_id: str) -> Any:
        """Make the thread (or find it, made meanwhile), then lock it as it is read again."""
        connection = connections[self.db]
        for _ in range(3):  # deleted meanwhile: made again
            thread, _ = self.get_or_create(owner_id=owner_id, thread_id=thread_id)
            with connection.cursor() as cursor:
                table = connection.ops.quote_name(self.model._meta.db_table)
                cursor.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR KEY SHARE", [thread.pk])
                if cursor.fetchone() is not None:
                    return thread
        raise RuntimeError(f"thread {thread_id!r} was deleted three times while being written to")

    def delete(self) -> tuple[int, dict[str, int]]:
        """Delete the threads and what hangs off them, once the writes under way to them are done.

        The threads are locked ``FOR UPDATE`` first: a writer holding one (``for_write``)
        finishes, and what it wrote is collected and deleted with the thread, where
        Django's collector would otherwise miss it and fail on its foreign key.
        """
        with transaction.atomic(using=self.db):
            # The same threads as a plain query on their keys: a grouped or DISTINCT queryset
            # cannot be locked itself, and a joined one would lock the joined rows too.
            chosen = self.model._base_manager.using(self.db).filter(pk__in=Subquery(self.values("pk")))
            list(chosen.order_by("pk").select_for_update().values_list("pk"))
            return chosen.delete()


class ThreadScopedQuerySet(models.QuerySet):
    """Rows that hang off a thread; the owner is the thread's."""

    def in_thread(self, owner: Owner, thread_id: str) -> Self:
        """Rows of ``owner``'s thread ``thread_id``.

        The thread's id is a scalar subquery, not a join: PostgreSQL then knows there is
        one thread and reads a (thread, ...) index in order, stopping at a limit. Through
        the join it sorted every event of the thread: get_recent_events(50) took 30 ms on
        a 100,000-event thread, 0.05 ms this way (BENCHMARKS.md, workload 2).
        """
        from .models import Thread  # the models import this module

        thread = Thread.objects.filter(owner_q(owner), thread_id=thread_id).order_by().values("pk")[:1]
        return self.filter(thread=Subquery(thread))


class EventQuerySet(ThreadScopedQuerySet):
    def newest_first(self) -> EventQuerySet:
        return self.order_by("-timestamp", "-id")

    def oldest_first(self) -> EventQuerySet:
        return self.order_by("timestamp", "id")

    def since(self, since_ms: int) -> EventQuerySet:
        return self.filter(timestamp__gte=since_ms)

    def after(self, timestamp: int, pk: int) -> EventQuerySet:
        """Events after the one at ``(timestamp, pk)`` in thread order: a keyset cursor, exact under ties.

        ``timestamp >= `` beside the OR, which says the same, is what the (thread, timestamp,
        id) index starts its scan at: from the OR alone, PostgreSQL read the thread from its
        first event to the cursor's and filtered them out, on every page (48 ms halfway
        through 600,000 events).
        """
        return self.filter(Q(timestamp__gt=timestamp) | Q(timestamp=timestamp, pk__gt=pk), timestamp__gte=timestamp)


class JournalKey(models.Func):
    """A checkpoint's or effect's state key in SQL: ``<head><run_id>:<step>:<last>``, by code point.

    The expression of their ``(thread, key)`` indexes (``Checkpoint.STATE_KEY``,
    ``Effect.STATE_KEY``): a database uses an index on an expression only for that very
    expression, so queries take it from the model. The key's text order is not the
    columns' (run ``a-1`` sorts before run ``a``, step 10 before step 9), so a page of the
    state in key order cannot walk the ``(thread, run_id, step, ...)`` constraint.
    The step is cast to text (``text || bigint`` is only stable on PostgreSQL, not
    immutable), and PostgreSQL compares with ``COLLATE "C"``, as Python compares strings.
    Migration 0007 built the indexes from this SQL: a change to it needs a migration that
    rebuilds them (``tests/test_schema_indexes.py`` pins it).
    """

    output_field = models.TextField()

    def __init__(self, head: str, last: str) -> None:
        if not (head[:-1].isascii() and head[:-1].isalpha() and head.endswith(":")):
            raise ValueError(f"a journal key's head is a word and ':', got {head!r}")  # it is inlined in SQL
        super().__init__(models.F("run_id"), models.F("step"), models.F(last))
        self.head = head

    def as_sql(
        self,
        compiler: Any,
        connection: Any,
        function: str | None = None,
        template: str | None = None,
        arg_joiner: str | None = None,
        **extra_context: Any,
    ) -> tuple[str, list[Any]]:
        (run_id, step, last), params = zip(*(compiler.compile(e) for e in self.get_source_expressions()), strict=True)
        sql = f"('{self.head}' || {run_id} || ':' || CAST({step} AS TEXT) || ':' || {last})"
        if connection.vendor == "postgresql":
            sql = f'({sql} COLLATE "C")'
        return sql, [p for part in params for p in part]


class KeyedQuerySet(ThreadScopedQuerySet):
    """Rows under a thread listed by a string-prefix column: state keys, checkpoints' and effects' run ids."""

    def with_prefix(self, prefix: str | None, field: str = "key") -> KeyedQuerySet:
        if not prefix:
            return self
        low, high = prefix_bounds(prefix)
        qs = self.filter(**{f"{field}__gte": low})
        return qs.filter(**{f"{field}__lt": high}) if high is not None else qs

    def key_range(self, prefix: str | None, after: str | None) -> KeyedQuerySet:
        """Rows whose state key (annotated ``state_key``) starts with ``prefix`` and comes after
        ``after``, in key order: a range of the model's ``(thread, key)`` index.

        The key is the ``key`` column, or the model's ``STATE_KEY`` expression (``JournalKey``).
        """
        qs = self.annotate(state_key=getattr(self.model, "STATE_KEY", models.F("key"))).with_prefix(prefix, "state_key")
        if after is not None:
            qs = qs.filter(state_key__gt=after)
        return qs.order_by("state_key")


#: ``TextSearch`` templates: the match (what the GIN index serves) and the ranking.
MATCHES = "{vector} @@ {query}"
RANK = "-ts_rank_cd({vector}, {query})"


class TextSearch(models.Func):
    """``template`` over a memory's text search vector and ``plainto_tsquery`` of ``terms`` (PostgreSQL).

    The vector is the stored ``search_vector`` column (``stored``: ``indexes.stored_vectors``),
    else ``to_tsvector(config, search_text)``, the expression index's. Either way it names the
    row through the query's alias for the table, not the table: inside a subquery the table
    has an alias, and raw SQL naming the table would refer to the outer query's rows.
    """

    def __init__(
        self, template: str, terms: Sequence[str], stored: bool, output_field: models.Field | None = None
    ) -> None:
        super().__init__(
            models.F("search_text"), models.Value(" ".join(terms)), output_field=output_field or models.BooleanField()
        )
        self.search_template, self.stored = template, stored

    def as_sql(
        self,
        compiler: Any,
        connection: Any,
        function: str | None = None,
        template: str | None = None,
        arg_joiner: str | None = None,
        **extra_context: Any,
    ) -> tuple[str, list[Any]]:
        (column, column_params), (query, query_params) = (compiler.compile(e) for e in self.get_source_expressions())
        vector = indexes.stored_vector_sql(column) if self.stored else indexes.tsvector_sql(column)
        tsquery = f"plainto_tsquery('{indexes.text_search_config()}'::regconfig, {query})"
        return self.search_template.format(vector=vector, query=tsquery), [*column_params, *query_params]


class MemoryQuerySet(OwnedQuerySet):
    def for_user(self, user_id: str | None, scope: str | None = None) -> MemoryQuerySet:
        qs = self.filter(user_id__isnull=True) if user_id is None else self.filter(user_id=user_id)
        return qs.filter(scope=scope) if scope is not None else qs

    def named(self, memory_id: str) -> MemoryQuerySet:
        return self.filter(memory_id=memory_id)

    def newest_first(self) -> MemoryQuerySet:
        return self.order_by("-updated_at", "memory_id")

    def after(self, updated_at: int, memory_id: str) -> MemoryQuerySet:
        """Memories after the one at ``(updated_at, memory_id)`` in ``newest_first`` order: a keyset cursor.

        The order runs two ways, so no row comparison says it: the OR does. ``updated_at <=``
        beside it, which says nothing more, is what the (owner, -updated_at, memory_id) index
        (with ``for_user``, the (owner, user_id, -updated_at, memory_id) one) starts its scan
        at; from the OR alone PostgreSQL reads the account's memories from the newest to the
        cursor and filters them out (as event cursors did: ``EventQuerySet.after``).
        """
        later = Q(updated_at__lt=updated_at) | Q(updated_at=updated_at, memory_id__gt=memory_id)
        return self.filter(later, updated_at__lte=updated_at)

    def with_embedding(self) -> MemoryQuerySet:
        return self.filter(embedding__isnull=False)

    def matching(self, terms: Sequence[str]) -> MemoryQuerySet:
        """Memories whose search text holds every one of ``terms`` (``query_terms``), stemmed.

        Through the text index: PostgreSQL's GIN index on the text search vector
        (``TEXT_SEARCH_CONFIG``), SQLite's FTS5 table (porter tokenizer).
        """
        vendor = connections[self.db].vendor
        if vendor == "postgresql":
            return self.filter(TextSearch(MATCHES, terms, indexes.stored_vectors(self.db)))
        if vendor == "sqlite":
            fts = indexes.FTS_TABLE
            match = " ".join('"' + term.replace('"', '""') + '"' for term in terms)
            return self.filter(id__in=RawSQL(f"SELECT rowid FROM {fts} WHERE {fts} MATCH %s", [match]))
        raise NotImplementedError(f"text search is not implemented for the {vendor} database")

    def ranked_matching(self, terms: Sequence[str]) -> MemoryQuerySet:
        """``matching(terms)`` on PostgreSQL, annotated ``rank``: minus ``ts_rank_cd``, best first ascending.

        Match and rank read the same vector (both the stored one, or both the expression).
        """
        stored = indexes.stored_vectors(self.db)
        rank = TextSearch(RANK, terms, stored, output_field=models.FloatField())
        return self.filter(TextSearch(MATCHES, terms, stored)).annotate(rank=rank)

    def in_scope(self, scope: str) -> MemoryQuerySet:
        return self.filter(scope=scope)

    def with_tag(self, tag: str, *, through_index: bool = True) -> MemoryQuerySet:
        """Memories whose ``tags`` list contains ``tag`` exactly (JSON containment; SQLite has none).

        On PostgreSQL ``tags @> '["tag"]'``, which the GIN index of migration 0011 serves: the
        account's memories of a rare tag are found without reading the others. With
        ``through_index=False`` the same test in a form that index does not serve (``IS
        TRUE``; the planner keeps its estimate of the tag), for a query with a narrower index
        at hand (one user's memories): where the estimate of a common tag came out rare, it
        combined the user's index with the tag's whole list in the GIN index, 8x slower for a
        tag on 60,000 memories.
        """
        table = self.model._meta.db_table
        if connections[self.db].vendor == "sqlite":
            condition = RawSQL(
                f'EXISTS (SELECT 1 FROM json_each("{table}"."tags") WHERE value = %s)',
                [tag],
                output_field=models.BooleanField(),
            )
            return self.filter(condition)
        if through_index:
            return self.filter(tags__contains=[tag])
        condition = RawSQL(
            f'("{table}"."tags" @> %s::jsonb) IS TRUE',
            [json.dumps([tag])],
            output_field=models.BooleanField(),
        )
        return self.filter(condition)


class StoreItemQuerySet(OwnedQuerySet):
    def live(self, now: Any = None) -> StoreItemQuerySet:
        """Items that have not expired (every read goes through this)."""
        now = now or timezone.now()
        return self.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))

    def expired(self, now: Any = None) -> StoreItemQuerySet:
        """Items whose TTL has run out (what the sweeper deletes)."""
        return self.filter(expires_at__lte=now or timezone.now())

    def in_namespace(self, prefix: tuple[str, ...]) -> StoreItemQuerySet:
        """Items whose namespace starts with the tuple ``prefix`` (``()``: every item).

        A btree range on the encoded namespace (see ``afkmemory.namespaces``), never LIKE:
        segments match literally, ``("a",)`` never matches ``("ab",)`` or ``("a.b",)``.
        """
        return self.in_namespace_range(*namespace_range(encode_prefix(prefix)))

    def in_namespace_range(self, low: str | None, high: str | None) -> StoreItemQuerySet:
        """Items whose encoded namespace is in ``[low, high)`` (``namespace_range``); None: no bound."""
        qs = self if low is None else self.filter(namespace__gte=low)
        return qs if high is None else qs.filter(namespace__lt=high)

    def at(self, namespace: tuple[str, ...], key: str) -> StoreItemQuerySet:
        """The item at ``(namespace, key)``: one lookup in the unique index."""
        return self.at_encoded(encode(namespace), key)

    def at_encoded(self, encoded: str, key: str) -> StoreItemQuerySet:
        """``at()`` with the namespace already encoded (``afkmemory.namespaces.encode``)."""
        return self.filter(namespace=encoded, key=key)

    def at_any_encoded(self, pairs: list[tuple[str, str]]) -> StoreItemQuerySet:
        """The items at any of the encoded ``(namespace, key)`` pairs: one index lookup each."""
        return self.filter(functools.reduce(operator.or_, (Q(namespace=n, key=k) for n, k in pairs)))
