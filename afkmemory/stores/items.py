"""agentflow's ``Store`` on the Django ORM: ``SyncDjangoStore`` and ``DjangoStore``."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from agentflow.errors import StoreConflict
from agentflow.store.base import Item, Namespace
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import connections, transaction
from django.utils import timezone
from django.utils.connection import ConnectionDoesNotExist
from django.utils.dateparse import parse_datetime

from .. import models
from ..conf import MAX_DELETE_BATCH_SIZE, afk_settings
from ..memory.types import check_count, json_round_trip
from ..namespaces import check_key, check_namespace, decode, encode, encode_prefix
from ..querysets import namespace_range
from . import asyncpool
from .bulk import DeleteByPk
from .concurrency import database_busy, hop, merged
from .prepared import DistinctScan, PreparedQuery, builder, native_timestamps, statement_connection, vendor

__all__ = ["DjangoStore", "SyncDjangoStore"]

ITEM_FIELDS = ("namespace", "key", "value", "created_at", "updated_at", "expires_at")


def _iso(moment: datetime | None) -> str | None:
    """Return ``moment`` as agentflow writes timestamps: ISO-8601 in UTC (``+00:00``)."""
    return None if moment is None else moment.astimezone(UTC).isoformat()


def _as_datetime(value: Any, using: str) -> datetime:
    """Return a timestamp read by raw SQL as an aware UTC datetime (SQLite may hand back text)."""
    if isinstance(value, str):
        parsed = parse_datetime(value)
        if parsed is None:
            raise ValueError(f"unreadable timestamp {value!r} from the database")
        value = parsed
    if timezone.is_naive(value):
        # A database without time zones (SQLite) holds them in its alias's TIME_ZONE (UTC unless set).
        value = timezone.make_aware(value, statement_connection(using).timezone)
    return value.astimezone(UTC)


def _check_ttl(ttl: Any) -> float | None:
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise TypeError(f"ttl must be a number of seconds or None, got {type(ttl).__name__}")
    refusal = "ttl must be a finite number of seconds >= 0 (None: never expire)"
    try:
        seconds = float(ttl)
    except OverflowError:  # an int past any float (too long to print, too)
        if ttl < 0:
            raise ValueError(f"{refusal}, got a negative one") from None
        raise TTLOverflowError("ttl ends after the year 9999; use None for no expiry") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{refusal}, got {ttl!r}")
    return seconds


class TTLOverflowError(ValueError, OverflowError):
    """A ttl that ends after the year 9999: a ``ValueError``, and the ``OverflowError`` agentflow's stores raise."""


def _expiry(now: datetime, ttl: float | None) -> datetime | None:
    if ttl is None:
        return None
    try:
        return now + timedelta(seconds=ttl)
    except OverflowError:
        raise TTLOverflowError(f"ttl of {ttl!r} seconds ends after the year 9999; use None for no expiry") from None


def check_alias(using: Any) -> str:
    """Return ``using`` if ``settings.DATABASES`` has that alias, else raise Django's ``ConnectionDoesNotExist``.

    Checked when a store is made, not at its first statement (a bare ``KeyError`` then).
    """
    if not isinstance(using, str) or using not in connections.settings:
        aliases = sorted(connections.settings)
        raise ConnectionDoesNotExist(f"database alias {using!r} is not in settings.DATABASES ({aliases})")
    return using


def check_owner(owner: Any) -> Any:
    """Return ``owner``: None, a saved user, or a user's primary key as the user model's key field has it.

    A user without a primary key (unsaved, anonymous) is refused: its rows would pass as
    nobody's. A key is converted (``"1"`` to ``1`` for an integer key), as the compiled
    statements compare it with the column.
    """
    if owner is None:
        return None
    key = getattr(owner, "pk", owner)
    if key is None:
        raise ValueError("owner must be a saved user or its primary key (not an unsaved or anonymous user)")
    if key is not owner:
        return owner
    try:
        return models.StoreItem._meta.get_field("owner").target_field.to_python(owner)
    except ValidationError:
        raise ValueError(f"owner must be a saved user or its primary key, got {owner!r}") from None


#: The hot reads, compiled once per database and shape (see ``prepared``): building the
#: queryset each time cost three times the lookup itself.
_LIVE_ITEM = PreparedQuery(
    lambda owner, encoded, key, now: models.StoreItem.objects.for_owner(owner)
    .live(now)
    .at_encoded(encoded, key)
    .order_by()  # one row at most: the model's ordering would only add a sort
    .values_list(*ITEM_FIELDS)[:1]
)

#: Several gets at once (``DjangoStore.get`` batched on the pool): ``pairs`` is the
#: encoded namespaces and keys, flat (``ns1, key1, ns2, key2, ...``).
_LIVE_ITEMS_AT = PreparedQuery(
    lambda owner, now, *pairs: models.StoreItem.objects.for_owner(owner)
    .live(now)
    .at_any_encoded(list(zip(pairs[::2], pairs[1::2], strict=True)))
    .order_by()
    .values_list(*ITEM_FIELDS)
)

_LIVE_ITEMS_UNDER = PreparedQuery(
    lambda owner, low, high, now, *, offset, limit: models.StoreItem.objects.for_owner(owner)
    .live(now)
    .in_namespace_range(low, high)
    .order_by("namespace", "key")
    .values_list(*ITEM_FIELDS)[offset : offset + limit]
)


def _live_under(owner: Any, low: str | None, high: str | None, now: datetime) -> models.StoreItemQuerySet:
    return models.StoreItem.objects.for_owner(owner).live(now).in_namespace_range(low, high)


#: ``list_namespaces``: one index probe per namespace (``DistinctScan``), not a read of
#: every item under the prefix; the plain ``DISTINCT`` is the fallback.
_LIVE_NAMESPACES_UNDER = DistinctScan(
    lambda owner, low, high, now: _live_under(owner, low, high, now).order_by("namespace").values_list("namespace")[:1],
    lambda owner, low, high, now, previous: _live_under(owner, low, high, now)
    .filter(namespace__gt=previous)
    .order_by("namespace")
    .values_list("namespace")[:1],
    distinct=PreparedQuery(
        lambda owner, low, high, now, *, offset, limit: _live_under(owner, low, high, now)
        .order_by("namespace")
        .values_list("namespace")
        .distinct()[offset : offset + limit]
    ),
)


@functools.lru_cache(maxsize=256)
def _upsert_sql(vendor: str, using: str, ownerless: bool, if_absent: bool, arrays: bool, rows: int = 1) -> str:
    """``put``'s statement for ``rows`` items (``_Put.stamp``'s 7 parameters each, one after another).

    It returns each written row's ``created_at, namespace, key``.

    An upsert keeps ``created_at`` of a live row; a row expired by the time of the
    write (its ``expires_at`` at or before the new ``updated_at``) starts a new life.
    With ``if_absent``, a live row makes ``DO UPDATE``'s ``WHERE`` false: nothing is
    written or returned, and that is the lost claim. Built once per database and shape
    (``vendor`` is part of the key): quoting every name cost more than the rest of a put.

    ``arrays`` (PostgreSQL only) takes any number of items as arrays, one parameter per
    column after the owner (``_upsert_arrays``): one statement text for every batch,
    which psycopg parses and the server prepares once. (psycopg parses a statement of
    more than 50 parameters anew on every call: 8 rows of 7 were a fifth of a batched put.)
    """
    connection = builder(using)  # built on the event loop too (see builder)
    q = connection.ops.quote_name
    table = q(models.StoreItem._meta.db_table)
    if ownerless:
        target = f"({q('namespace')}, {q('key')}) WHERE {q('owner_id')} IS NULL"
    else:
        target = f"({q('owner_id')}, {q('namespace')}, {q('key')}) WHERE {q('owner_id')} IS NOT NULL"
    expired = f"{table}.{q('expires_at')} IS NOT NULL AND {table}.{q('expires_at')} <= excluded.{q('updated_at')}"
    if if_absent:
        created = f"excluded.{q('created_at')}"
        condition = f" WHERE {expired}"
    else:
        created = f"CASE WHEN {expired} THEN excluded.{q('created_at')} ELSE {table}.{q('created_at')} END"
        condition = ""
    if arrays:
        if vendor != "postgresql":
            raise ValueError(f"a put of rows as arrays needs PostgreSQL, not {vendor}")
        owner = f"%s::{models.StoreItem._meta.get_field('owner').db_type(connection)}"
        columns = "%b::text[], %b::text[], %b::text[]::jsonb[], %b::timestamptz[], %b::timestamptz[], %b::timestamptz[]"
        source = f"SELECT {owner}, * FROM unnest({columns})"
    else:
        source = "VALUES " + ", ".join(["(%s, %s, %s, %s, %s, %s, %s)"] * rows)
    return (
        f"INSERT INTO {table} ({q('owner_id')}, {q('namespace')}, {q('key')}, {q('value')}, "
        f"{q('created_at')}, {q('updated_at')}, {q('expires_at')}) {source} "
        f"ON CONFLICT {target} DO UPDATE SET {q('value')} = excluded.{q('value')}, "
        f"{q('created_at')} = {created}, {q('updated_at')} = excluded.{q('updated_at')}, "
        f"{q('expires_at')} = excluded.{q('expires_at')}{condition} "
        f"RETURNING {q('created_at')}, {q('namespace')}, {q('key')}"
    )


def _rows_at(at: list[tuple[str, str]], rows: list[tuple[Any, ...]], first: int = 0) -> list[tuple[Any, ...] | None]:
    """The row for each encoded ``(namespace, key)`` of ``at`` (None where none came back).

    ``first`` is the position of the namespace in a row; the key follows it.
    """
    found = {(row[first], row[first + 1]): row for row in rows}
    return [found.get(pair) for pair in at]


class _Put:
    """A checked put on its way to the database, stamped with the clock as it is written.

    The TTL counts from the write, as agentflow's stores count it (PostgresStore's
    ``NOW()``), not from the call: a put that waited for the store's thread or a pool
    connection longer than its TTL was written already expired.
    """

    __slots__ = ("row", "ttl", "now", "expires_at")

    def __init__(self, row: list[Any], ttl: float | None, now: datetime) -> None:
        self.row = row  # the owner, the encoded namespace, the key, the value's JSON
        self.ttl = ttl
        self.now = now
        self.expires_at = _expiry(now, ttl)  # raises for the caller: a TTL ending after the year 9999

    @property
    def address(self) -> tuple[str, str]:
        """Where the row goes: its encoded namespace and its key."""
        return self.row[1], self.row[2]

    def stamp(self, now: datetime, adapt: Callable[[Any], Any]) -> list[Any]:
        """Stamp the put as written at ``now``; return the upsert's 7 parameters."""
        self.now = now
        with contextlib.suppress(TTLOverflowError):  # the call was that close to the end: its end as then
            self.expires_at = _expiry(now, self.ttl)
        return [*self.row, adapt(now), adapt(now), adapt(self.expires_at)]


def _stamped(puts: list[_Put], using: str) -> list[list[Any]]:
    """The puts' parameters, written now."""
    now = timezone.now()
    adapt = statement_connection(using).ops.adapt_datetimefield_value
    return [put.stamp(now, adapt) for put in puts]


def _upsert_arrays(rows: list[list[Any]]) -> list[Any]:
    """The parameters of ``_upsert_sql(..., arrays=True)``: one owner, then each column's values in a list."""
    owners, *columns = zip(*rows, strict=True)
    return [owners[0], *(list(column) for column in columns)]


class SyncDjangoStore:
    """All of ``DjangoStore``'s logic as plain sync methods, for views and tasks.

    ``owner`` scopes every row to one account (None: rows without an owner); ``using``
    names the database alias. Methods mirror agentflow's ``Store`` protocol and raise
    ``TypeError``/``ValueError`` on bad input before touching the database.

    Every timestamp is computed here, in Python, as aware UTC, and handed to the
    database as a parameter: SQLite and PostgreSQL then agree on what "now" and
    "expired" mean (``NOW()`` exists on one only, and would be the database server's clock).
    """

    model = models.StoreItem

    def __init__(self, *, owner: Any = None, using: str = "default") -> None:
        self.owner = check_owner(owner)
        self._owner_id = getattr(self.owner, "pk", self.owner)
        self.using = check_alias(using)

    def _items(self) -> models.StoreItemQuerySet:
        return self.model.objects.using(self.using).for_owner(self.owner)

    @staticmethod
    def _item(row: tuple[Any, ...]) -> Item:
        namespace, key, value, created_at, updated_at, expires_at = row
        return Item(decode(namespace), key, value, _iso(created_at) or "", _iso(updated_at) or "", _iso(expires_at))

    # -- reads -------------------------------------------------------------------------------

    # Each read checks its input and returns the arguments of its compiled query, which
    # DjangoStore may run on its own pool instead (see ``asyncpool``).

    @staticmethod
    def _at(namespace: Namespace, key: str) -> tuple[str, str]:
        """Check an item's address; return it as stored: the encoded namespace and the key."""
        encoded = encode(namespace)
        check_key(key)
        return encoded, key

    def _under_args(
        self, prefix: Namespace, name: str, limit: int, offset: int, now: Any = None
    ) -> tuple[tuple[Any, ...], dict[str, int]] | None:
        """The arguments and shape of a listing under ``prefix`` at ``now`` (None: the time now); None for limit 0."""
        check_namespace(prefix, name, allow_empty=True)
        check_count(limit, "limit")
        check_count(offset, "offset")
        if limit == 0:
            return None
        bounds = namespace_range(encode_prefix(prefix))
        return (self._owner_id, *bounds, timezone.now() if now is None else now), {"offset": offset, "limit": limit}

    @staticmethod
    def _namespaces(rows: list[tuple[Any, ...]]) -> list[Namespace]:
        return [decode(namespace) for (namespace,) in rows]

    def get(self, namespace: Namespace, key: str) -> Item | None:
        """Return the live item at ``(namespace, key)``, or None."""
        return self._get_many([self._at(namespace, key)])[0]

    def search(self, namespace_prefix: Namespace, *, limit: int = 100, offset: int = 0) -> list[Item]:
        """Return live items under ``namespace_prefix`` (``()``: all), by namespace then key."""
        listing = self._under_args(namespace_prefix, "namespace_prefix", limit, offset)
        if listing is None:
            return []
        return [self._item(row) for row in _LIVE_ITEMS_UNDER.rows(self.using, *listing[0], **listing[1])]

    def list_namespaces(self, *, prefix: Namespace = (), limit: int = 100, offset: int = 0) -> list[Namespace]:
        """Return the sorted distinct namespaces under ``prefix`` that hold a live item."""
        listing = self._under_args(prefix, "prefix", limit, offset)
        if listing is None:
            return []
        return self._namespaces(_LIVE_NAMESPACES_UNDER.rows(self.using, *listing[0], **listing[1]))

    # -- writes ------------------------------------------------------------------------------

    def put(
        self,
        namespace: Namespace,
        key: str,
        value: Any,
        *,
        ttl: float | None = None,
        if_absent: bool = False,
    ) -> Item:
        """Store ``value`` at ``(namespace, key)`` and return the stored item.

        An upsert keeps ``created_at`` of a live item and refreshes ``updated_at``; over an
        expired item it is a fresh insert (new ``created_at``). ``ttl`` is seconds from now.
        ``if_absent=True`` writes only when no live item is there, else raises
        ``StoreConflict``: one ``INSERT ... ON CONFLICT DO UPDATE ... WHERE expired``
        statement, so racing writers, in any number of processes, get exactly one winner.
        """
        put, result = self._prepare_put(namespace, key, value, ttl)
        # One statement, atomic by itself: PostgreSQL's ON CONFLICT locks the conflicting row,
        # SQLite takes its write lock before the statement reads anything. So no transaction
        # around it: in autocommit it commits itself, in one round trip instead of three
        # (BEGIN, the statement, COMMIT); inside a caller's transaction it is part of that one.
        return result(self._upsert_row(put, if_absent=if_absent))

    def save(
        self,
        namespace: Namespace,
        key: str,
        value: Any,
        *,
        ttl: float | None = None,
        if_absent: bool = False,
    ) -> tuple[Item, bool]:
        """``put``, also returning whether it created the item (the API's 201 or 200).

        Decided by the statements, not by comparing timestamps (two puts can be stamped in
        the same microsecond): first the atomic ``if_absent`` put, which one of racing
        creators wins; if a live item is there, the plain put, unless ``if_absent`` was
        asked for (``StoreConflict``).
        """
        try:
            return self.put(namespace, key, value, ttl=ttl, if_absent=True), True
        except StoreConflict:
            if if_absent:
                raise
        return self.put(namespace, key, value, ttl=ttl), False

    def _upsert_row(self, put: _Put, *, if_absent: bool) -> tuple[Any, ...] | None:
        """Upsert one item; return its written row, None for a lost claim."""
        with connections[self.using].cursor() as cursor:
            native_timestamps(cursor)
            cursor.execute(self._upsert_sql(if_absent=if_absent), _stamped([put], self.using)[0])
            return cursor.fetchone()

    def _upsert_sql(self, *, if_absent: bool, arrays: bool = False, rows: int = 1) -> str:
        """This store's upsert of ``rows`` items, or of rows as arrays (see ``_upsert_sql``)."""
        return _upsert_sql(vendor(self.using), self.using, self._owner_id is None, if_absent, arrays, rows)

    # -- several calls at once ------------------------------------------------------------------

    # DjangoStore's concurrent ``get`` and ``put`` calls that share a hop (``concurrency.merged``)
    # are answered here together, on Django's connection of the hop's thread.

    def _get_many(self, at: list[tuple[str, str]]) -> list[Item | None]:
        """The live items at encoded ``(namespace, key)`` pairs (``_at``), in one statement."""
        if len(at) == 1:
            rows = _LIVE_ITEM.rows(self.using, self._owner_id, *at[0], timezone.now())
        else:
            flat = [part for pair in at for part in pair]
            rows = _LIVE_ITEMS_AT.rows(self.using, self._owner_id, timezone.now(), *flat)
        return [None if row is None else self._item(row) for row in _rows_at(at, rows)]

    def _put_many(self, puts: list[_Put]) -> list[Any]:
        """Upsert items; return each one's returned row, or its own error.

        In autocommit, items of distinct keys go as one statement (sorted by key, so that
        two such statements lock their rows in the same order). If it fails, none of it
        was written (or all of it, and writing it again changes nothing), and each item is
        sent alone, so that only the callers whose own item fails get an error; unless SQLite
        was locked, which every caller then gets. Inside a
        transaction each item is its own statement, as when the calls came one by one: a
        failure there aborts the transaction for the rest.
        """
        connection = connections[self.using]
        at = [put.address for put in puts]
        if len(puts) > 1 and len(set(at)) == len(puts) and connection.get_autocommit():
            ordered = _stamped(sorted(puts, key=lambda put: put.address), self.using)
            sql = self._upsert_sql(if_absent=False, rows=len(puts))
            try:
                with connection.cursor() as cursor:
                    native_timestamps(cursor)
                    cursor.execute(sql, [value for params in ordered for value in params])
                    returned = cursor.fetchall()
            except Exception as error:  # e.g. one value the driver cannot encode: the statement did not run
                if database_busy(error):  # each put alone would wait for the lock again
                    raise
            else:
                return _rows_at(at, returned, 1)
        answers: list[Any] = []
        for put in puts:
            try:
                answers.append(self._upsert_row(put, if_absent=False))
            except Exception as error:
                answers.append(error)
        return answers

    def _prepare_put(
        self, namespace: Namespace, key: str, value: Any, ttl: float | None
    ) -> tuple[_Put, Callable[[Any], Item]]:
        """Check a ``put``; return it, to be written, and what turns its returned row into the item."""
        encoded, key = self._at(namespace, key)
        stored, text = json_round_trip(value, "value")  # what a get would return (tuples become lists), as JSON
        connection = statement_connection(self.using)  # from the event loop too (the pool)
        row = [
            self.model._meta.get_field("owner").get_db_prep_value(self._owner_id, connection),
            encoded,
            key,
            # The JSON text, which the column's type takes as it is (jsonb parses it; SQLite
            # keeps text): the value is serialized once. None stays SQL NULL, as Django stores it.
            None if stored is None else text,
        ]
        put = _Put(row, _check_ttl(ttl), timezone.now())

        def result(returned: Any) -> Item:
            if returned is None:
                raise StoreConflict(namespace, key)
            created = _as_datetime(returned[0], self.using)
            return Item(namespace, key, stored, _iso(created) or "", _iso(put.now) or "", _iso(put.expires_at))

        return put, result

    def delete(self, namespace: Namespace, key: str) -> bool:
        """Delete the item; return True if a live one was removed.

        An expired item already counts as absent (False), but its row goes too.
        """
        check_namespace(namespace)
        check_key(key)
        now = timezone.now()
        with transaction.atomic(using=self.using):
            at_key = self._items().at(namespace, key)
            removed = at_key.live(now).delete()[0]
            at_key.expired(now).delete()
        return removed > 0

    def sweep_expired(
        self, batch_size: int | None = None, *, now: datetime | None = None, all_owners: bool = False
    ) -> int:
        """Delete expired items in batches of ``batch_size``; return how many were deleted.

        Reads need no sweep (they skip expired rows); this reclaims space. Each batch is
        its own short transaction, found through the expiry index; on PostgreSQL its rows
        are taken ``FOR UPDATE SKIP LOCKED`` so concurrent sweepers split the work instead
        of waiting on each other. ``batch_size`` defaults to ``DELETE_BATCH_SIZE``; ``now``
        (as ``timezone.now()`` gives it: aware, or naive when ``USE_TZ`` is False) to the
        current time. ``all_owners`` sweeps every account's items, not only this store's
        owner's (what the cron command does).
        """
        return sum(self._expired_batches(batch_size, now=now, all_owners=all_owners))

    def _expired_batches(
        self, batch_size: int | None = None, *, now: datetime | None = None, all_owners: bool = False
    ) -> Iterator[int]:
        """``sweep_expired`` a batch at a time: yield how many each batch deleted, between its transactions."""
        if batch_size is None:
            size = afk_settings.whole_number("DELETE_BATCH_SIZE")
        else:
            size = check_count(batch_size, "batch_size", minimum=1, maximum=MAX_DELETE_BATCH_SIZE)
        if now is None:
            now = timezone.now()
        elif not isinstance(now, datetime) or timezone.is_naive(now) == settings.USE_TZ:
            kind = "an aware" if settings.USE_TZ else "a naive (USE_TZ is False)"
            raise TypeError(f"now must be {kind} datetime, such as django.utils.timezone.now()")
        items = self.model.objects.using(self.using)
        if not all_owners:
            items = items.for_owner(self.owner)
        skip_locked = connections[self.using].features.has_select_for_update_skip_locked
        delete = DeleteByPk(items.expired(now))  # still expired: the batch is checked again as it goes
        while True:
            with transaction.atomic(using=self.using):
                batch = items.expired(now).order_by("expires_at")
                if skip_locked:
                    batch = batch.select_for_update(skip_locked=True)
                ids = list(batch.values_list("id", flat=True)[:size])
                deleted = delete(ids) if ids else 0
            yield deleted
            if len(ids) < size:
                return


class DjangoStore:
    """agentflow's ``Store`` on the Django ORM (SQLite, PostgreSQL).

    ``isinstance(DjangoStore(), agentflow.store.Store)`` holds; items are
    ``agentflow.store.Item`` and a lost ``if_absent`` claim raises
    ``agentflow.errors.StoreConflict``, so ``IdempotentOp`` and ``skip_if_done`` work
    unchanged. Each method is one ``sync_to_async`` hop into ``SyncDjangoStore``: the ORM
    and its transactions are synchronous, so a whole operation runs in one sync function
    rather than paying a thread hop per query. Concurrent calls bound for one thread share
    a hop, and their ``get``s and ``put``s a statement (``afkmemory.stores.concurrency``,
    ``SyncDjangoStore._get_many`` and ``_put_many``). With ``async_pool=True`` (None, the
    default, follows the ``ASYNC_POOL`` setting), ``get``, ``put``, ``search`` and
    ``list_namespaces`` on PostgreSQL send their one statement from the event loop on
    connections of their own instead, outside Django's transactions
    (``afkmemory.stores.asyncpool``).
    """

    def __init__(self, *, owner: Any = None, using: str = "default", async_pool: bool | None = None) -> None:
        self.sync = SyncDjangoStore(owner=owner, using=using)
        self.async_pool = asyncpool.check_choice(using, async_pool)

    async def get(self, namespace: Namespace, key: str) -> Item | None:
        sync = self.sync
        at = sync._at(namespace, key)
        kind = ("get", sync.using, sync._owner_id)
        if not asyncpool.pooled(sync.using, self.async_pool):
            return await merged(kind, sync._get_many, at)
        # The batch reads at the time it goes out: one "now" for all its calls.
        row = await asyncpool.batched(sync.using, kind, at, self._get_many)
        return None if row is None else sync._item(row)

    async def _get_many(self, pairs: list[tuple[str, str]]) -> list[tuple[Any, ...] | None]:
        """The rows at encoded ``(namespace, key)`` pairs (None: no live item), in one statement."""
        sync = self.sync
        flat = [part for pair in pairs for part in pair]
        rows = await asyncpool.rows(_LIVE_ITEMS_AT, sync.using, sync._owner_id, asyncpool.NOW, *flat)
        return _rows_at(pairs, rows)

    async def put(
        self,
        namespace: Namespace,
        key: str,
        value: Any,
        *,
        ttl: float | None = None,
        if_absent: bool = False,
    ) -> Item:
        sync = self.sync
        pooled = asyncpool.pooled(sync.using, self.async_pool)
        if if_absent and not pooled:
            return await hop(type(sync).put)(sync, namespace, key, value, ttl=ttl, if_absent=True)
        put, result = sync._prepare_put(namespace, key, value, ttl)
        kind = ("put", sync.using, sync._owner_id)
        if not pooled:
            return result(await merged(kind, sync._put_many, put))
        if if_absent:  # a claim goes alone: its answer is whether it won
            sql = sync._upsert_sql(if_absent=True)
            rows = await asyncpool.fetch(sync.using, sql, lambda: _stamped([put], sync.using)[0])
            return result(rows[0] if rows else None)
        return result(await asyncpool.batched(sync.using, kind, put, self._put_many, unique=put.address))

    async def _put_many(self, puts: list[_Put]) -> list[tuple[Any, ...] | None]:
        """Upsert the puts (distinct keys) in one statement; return each one's row.

        Sorted by key, so that two batches lock their rows in the same order; stamped once
        the statement has a connection.
        """
        sync = self.sync
        if len(puts) == 1:
            sql = sync._upsert_sql(if_absent=False)
            returned = await asyncpool.fetch(sync.using, sql, lambda: _stamped(puts, sync.using)[0])
        else:
            ordered = sorted(puts, key=lambda put: put.address)
            sql = sync._upsert_sql(if_absent=False, arrays=True)
            returned = await asyncpool.fetch(sync.using, sql, lambda: _upsert_arrays(_stamped(ordered, sync.using)))
        return _rows_at([put.address for put in puts], returned, 1)

    async def delete(self, namespace: Namespace, key: str) -> bool:
        return await hop(type(self.sync).delete)(self.sync, namespace, key)

    async def search(self, namespace_prefix: Namespace, *, limit: int = 100, offset: int = 0) -> list[Item]:
        sync = self.sync
        if not asyncpool.pooled(sync.using, self.async_pool):
            return await hop(type(sync).search)(sync, namespace_prefix, limit=limit, offset=offset)
        listing = sync._under_args(namespace_prefix, "namespace_prefix", limit, offset, asyncpool.NOW)
        if listing is None:
            return []
        rows = await asyncpool.rows(_LIVE_ITEMS_UNDER, sync.using, *listing[0], **listing[1])
        return [sync._item(row) for row in rows]

    async def list_namespaces(self, *, prefix: Namespace = (), limit: int = 100, offset: int = 0) -> list[Namespace]:
        sync = self.sync
        if not asyncpool.pooled(sync.using, self.async_pool):
            return await hop(type(sync).list_namespaces)(sync, prefix=prefix, limit=limit, offset=offset)
        listing = sync._under_args(prefix, "prefix", limit, offset, asyncpool.NOW)
        if listing is None:
            return []
        return sync._namespaces(await asyncpool.rows(_LIVE_NAMESPACES_UNDER, sync.using, *listing[0], **listing[1]))

    async def sweep_expired(
        self, batch_size: int | None = None, *, now: datetime | None = None, all_owners: bool = False
    ) -> int:
        return await hop(type(self.sync).sweep_expired)(self.sync, batch_size, now=now, all_owners=all_owners)
