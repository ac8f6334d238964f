"""Querysets compiled to SQL once, then run again with new arguments: the stores' hot reads.

Building and compiling a queryset costs more Python than an indexed lookup costs the
database: ``SyncDjangoStore.get`` spent about 0.4 of its 0.54 ms in ``filter()`` and
``SQLCompiler.as_sql`` (BENCHMARKS.md, "Profiles and fixes"). A ``PreparedQuery`` keeps
the queryset as the one statement of what is read (the queryset methods stay the only
place a filter is spelt) and compiles it once per database and shape; each call then
fills in its arguments and runs the SQL through Django's own cursor, so transactions,
``execute_wrapper`` hooks and query logging behave as for any ORM query, and Django's
converters turn the rows into the same Python values ``values_list()`` gives.

How arguments find their place: the builder is called once with *placeholder* values
(unlikely strings, integers and datetimes, one per argument) and the compiled parameters
are searched for them. Every placeholder must be found, and every other parameter is a
constant of the query, so a builder that reads anything but its arguments (the clock, a
setting) would freeze that value into the statement: builders must be pure functions of
their arguments and shape. What changes the SQL text itself (``IS NULL`` for no owner, a
``LIMIT``) is the *shape*, part of the cache key.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Hashable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar, cast

from django.conf import settings
from django.core.exceptions import EmptyResultSet
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import QuerySet

__all__ = [
    "DistinctScan",
    "PreparedQuery",
    "argument_slots",
    "native_timestamp_loader",
    "native_timestamps",
    "placeholder",
    "planned_each_time",
    "vendor",
]

#: How many compiled shapes a PreparedQuery keeps (each limit and offset is a shape).
MAX_SHAPES = 256

#: Placeholder datetimes: distinct seconds of the year 2, which no real row holds. Not the
#: year 1: compiling converts them to the alias's time zone (SQLite's TIME_ZONE), and one
#: behind UTC put the year 1's first seconds in the year 0, which Python cannot represent.
_EPOCH = datetime(2, 1, 1, tzinfo=UTC)


#: The argument types a placeholder can stand for; None is compiled into the SQL (IS NULL).
_PLACEHOLDER_TYPES = (int, str, datetime, type(None))


_builders: dict[tuple[str, str], BaseDatabaseWrapper] = {}


def builder(using: str) -> BaseDatabaseWrapper:
    """A ``DatabaseWrapper`` of ``using`` for building statements and adapting values, from any thread.

    ``connections[using]`` is the calling thread's connection, and in an event loop's thread
    asgiref keeps it in a context variable made for that thread, which ``async_to_sync``
    copies back into its sync caller's context: a worker calling the pooled stores through
    ``async_to_sync`` (a new loop thread each time) collected one variable and one
    connection object per call, and every later ``sync_to_async`` walked them all (in the
    test suite a bare hop went from 0.06 to 5 ms). This one is made once per alias and
    engine and never connects: only its operations, settings and adapters are used.
    Reaching it is a dict lookup, where the context-local storage cost about 10 us.
    """
    key = (using, connections.settings[using]["ENGINE"])
    found = _builders.get(key)
    if found is None:
        found = _builders[key] = connections.create_connection(using)
    return found


def statement_connection(using: str) -> BaseDatabaseWrapper:
    """The connection to build a statement of ``using`` with: the thread's, or ``builder``'s in an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return connections[using]
    return builder(using)


def vendor(using: str) -> str:
    """``connections[using].vendor``, from any thread (see ``builder``)."""
    return builder(using).vendor


def placeholder(index: int, value: Any) -> Any:
    """The stand-in for argument ``index`` (of ``value``'s type) while a queryset is compiled once."""
    if value is None:  # None changes the SQL (IS NULL): it is part of the shape, not a parameter
        return None
    if isinstance(value, int):
        return -(2**62) - index
    if isinstance(value, str):
        return f"\u2063afkmemory-argument-{index}\u2063"
    # Naive without USE_TZ, as the arguments are: SQLite's adapter refuses an aware datetime then.
    return (_EPOCH if settings.USE_TZ else _EPOCH.replace(tzinfo=None)) + timedelta(seconds=index + 1)


def native_timestamps(cursor: Any) -> None:
    """Have a cursor of Django's read ``timestamptz`` with psycopg's own loader (``native_timestamp_loader``)."""
    if cursor.db.vendor == "postgresql":
        native_timestamp_loader(cursor.cursor.adapters)


def native_timestamp_loader(adapters: Any) -> None:
    """Have psycopg ``adapters`` (a cursor's, or a connection's) read ``timestamptz`` with psycopg's compiled loader.

    Django's PostgreSQL connection reads each ``timestamptz`` through a Python subclass of
    psycopg's loader, which parses it in Python and then puts the connection's zone on the
    result. That zone is the session's (Django sets the session's ``TimeZone`` to it), which
    psycopg's compiled loader reads it in already: the same instant at the same offset, for
    less (``SyncDjangoStore.search`` of 50 items, three timestamps each: 1.24 ms a call
    against 1.87, side by side in one process). Only with ``USE_TZ``: without it Django
    hands back naive times. A cursor's adapters are its own, so the connection's other
    queries are as Django makes them.
    """
    if settings.USE_TZ:
        from psycopg.types.datetime import TimestamptzLoader  # psycopg only where PostgreSQL is used

        adapters.register_loader("timestamptz", TimestamptzLoader)


Adapter = Callable[[Any], Any]


def argument_slots(
    sql: str, params: Sequence[Any], placeholders: Sequence[Any], adapt: Adapter | None = None
) -> list[tuple[int, int, Adapter | None]]:
    """Where each placeholder went among ``params``, the parameters compiled with ``sql``.

    Returns ``(position, argument index, adapter or None)`` for each parameter that is an
    argument: ``adapt`` (the backend's ``adapt_datetimefield_value``) when the compiler
    adapted a datetime placeholder. Every other parameter is a constant of the statement.
    Raises if a placeholder (other than None) reached no parameter of a statement: the
    builder changed it, and its argument would be lost.
    """
    slots: list[tuple[int, int, Adapter | None]] = []
    for index, stand_in in enumerate(placeholders):
        if stand_in is None:
            continue
        forms: list[tuple[Any, Adapter | None]] = [(stand_in, None)]
        if adapt is not None and isinstance(stand_in, datetime):
            forms.append((adapt(stand_in), adapt))
        found = []
        for position, param in enumerate(params):
            for form, adapter in forms:  # the value itself first: some backends adapt nothing
                if type(param) is type(form) and param == form:
                    found.append((position, index, adapter))
                    break
        if not found and sql:
            raise RuntimeError(f"argument {index} does not reach the SQL of {sql!r}: the builder changed it")
        slots += found
    return slots


class _Statement:
    """A compiled statement: its SQL ("": nothing to ask), its parameters for given arguments, its rows' conversion."""

    sql: str

    def bind(self, args: tuple[Any, ...]) -> list[Any]:
        raise NotImplementedError

    def convert(self, rows: list[Any]) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def run(self, using: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        if not self.sql:
            return []
        with connections[using].cursor() as cursor:
            native_timestamps(cursor)
            cursor.execute(self.sql, self.bind(args))
            return self.convert(cursor.fetchall())


class _Compiled(_Statement):
    """One shape of a query on one database: its SQL, where each argument goes, its converters."""

    def __init__(self, queryset: QuerySet, placeholders: list[Any], using: str) -> None:
        connection = connections[using]
        compiler = queryset.query.get_compiler(using=using)
        try:
            self.sql, params = compiler.as_sql()
        except EmptyResultSet:  # e.g. a limit of 0: nothing to ask the database
            self.sql, params = "", ()
        self.params = list(params)
        # For each parameter that is an argument: (position, argument index, adapter or None).
        self.slots = argument_slots(self.sql, self.params, placeholders, connection.ops.adapt_datetimefield_value)
        self.compiler = compiler
        self.converters = compiler.get_converters([s[0] for s in compiler.select[: compiler.col_count]])

    def bind(self, args: tuple[Any, ...]) -> list[Any]:
        """Return the statement's parameters with ``args`` in their places."""
        params = list(self.params)
        for position, index, adapter in self.slots:
            params[position] = args[index] if adapter is None else adapter(args[index])
        return params

    def convert(self, rows: list[Any]) -> list[tuple[Any, ...]]:
        """Return fetched rows as ``values_list()`` gives them (Django's JSON and datetime converters)."""
        if not rows or not self.converters:
            return rows
        return [tuple(row) for row in self.compiler.apply_converters(rows, self.converters)]


S = TypeVar("S", bound=_Statement)


class _Prepared(Generic[S]):
    """Statements compiled once per database, argument types and shape; at most ``MAX_SHAPES`` kept."""

    def __init__(self) -> None:
        self._compiled: dict[tuple[Any, ...], S] = {}

    def _compile(self, using: str, args: tuple[Any, ...], shape: dict[str, Hashable]) -> S:
        raise NotImplementedError

    def _uncompiled(self, using: str, args: tuple[Any, ...], shape: dict[str, Hashable]) -> list[tuple[Any, ...]]:
        """The rows for arguments no placeholder can stand for, without compiling."""
        raise NotImplementedError

    def rows(self, using: str, *args: Any, **shape: Hashable) -> list[tuple[Any, ...]]:
        compiled = self.compiled(using, args, shape)
        if compiled is None:
            return self._uncompiled(using, args, shape)
        return compiled.run(using, args)

    def _key(self, using: str, args: tuple[Any, ...], shape: dict[str, Hashable]) -> tuple[Any, ...] | None:
        kinds = tuple(type(arg) for arg in args)
        if not all(kind in _PLACEHOLDER_TYPES for kind in kinds):
            return None
        # The vendor is part of the key: a test may point an alias at another database.
        return (using, vendor(using), kinds, tuple(sorted(shape.items())))

    def compiled(self, using: str, args: tuple[Any, ...], shape: dict[str, Hashable]) -> S | None:
        """Return the statement for these arguments' shape, compiling it the first time.

        None: an argument no placeholder can stand for (see ``rows``). Compiling may
        read the database's features, so call this from sync code (``cached`` is safe
        anywhere).
        """
        key = self._key(using, args, shape)
        if key is None:
            return None
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(using, args, shape)
            if len(self._compiled) >= MAX_SHAPES:  # offsets of a long listing: start over, not grow
                self._compiled.clear()
            self._compiled[key] = compiled
        return compiled

    def cached(self, using: str, args: tuple[Any, ...], shape: dict[str, Hashable]) -> S | None:
        """Return the statement if it is already compiled, else None (no database access)."""
        key = self._key(using, args, shape)
        return None if key is None else self._compiled.get(key)


class PreparedQuery(_Prepared[_Compiled]):
    """A ``values_list()`` queryset built by ``build(*args, **shape)``, compiled once per database and shape.

    ``rows(using, *args, **shape)`` returns what ``list(build(*args, **shape))`` would,
    without building or compiling the queryset again. Arguments are strings, integers
    or datetimes that the queryset only compares against (see the module docstring), or
    None, which is compiled into the SQL like the shape; an argument of any other type
    runs the queryset uncompiled. ``shape`` holds whatever else changes the SQL text (a
    limit) and must be hashable.
    """

    def __init__(self, build: Callable[..., QuerySet]) -> None:
        super().__init__()
        self.build = build

    def _compile(self, using: str, args: tuple[Any, ...], shape: dict[str, Hashable]) -> _Compiled:
        placeholders = [placeholder(i, arg) for i, arg in enumerate(args)]
        return _Compiled(self.build(*placeholders, **shape).using(using), placeholders, using)

    def _uncompiled(self, using: str, args: tuple[Any, ...], shape: dict[str, Hashable]) -> list[tuple[Any, ...]]:
        # Another type (a UUID primary key of a custom user model, say): the field may
        # transform it in ways a placeholder cannot stand for, so run the queryset itself.
        return [tuple(row) for row in self.build(*args, **shape).using(using)]


_PARAMETER = re.compile(r"%%|%s")


class _Scan(_Statement):
    """One shape of a ``DistinctScan``: the recursive statement, and which arguments it takes where."""

    def __init__(self, first: _Compiled, after: _Compiled, previous: int, using: str, limit: int, offset: int):
        self.first, self.after = first, after
        if not first.sql:  # nothing can match: no statement to send
            self.sql = ""
            return
        [self.previous] = [position for position, index, _ in after.slots if index == previous]
        q = connections[using].ops.quote_name
        scan, value = q("scan"), q("value")
        count = -1

        def refer(match: re.Match[str]) -> str:
            nonlocal count
            if match.group() == "%%":
                return "%%"
            count += 1
            return f"{scan}.{value}" if count == self.previous else "%s"

        step = _PARAMETER.sub(refer, after.sql)
        self.sql = (
            f"WITH RECURSIVE {scan}({value}) AS (SELECT ({first.sql}) UNION ALL SELECT ({step})"
            f" FROM {scan} WHERE {scan}.{value} IS NOT NULL)"
            f" SELECT {value} FROM {scan} WHERE {value} IS NOT NULL LIMIT {int(limit)} OFFSET {int(offset)}"
        )

    def bind(self, args: tuple[Any, ...]) -> list[Any]:
        step = self.after.bind((*args, None))
        del step[self.previous]  # that one is the previous value, a column of the scan
        return self.first.bind(args) + step

    def convert(self, rows: list[Any]) -> list[tuple[Any, ...]]:
        return self.first.convert(rows)


class DistinctScan(_Prepared[_Scan]):
    """``SELECT DISTINCT column ... ORDER BY column`` as a loose index scan: one index probe per value.

    ``DISTINCT`` reads every row under the filter to find a few distinct values; a
    recursive statement that asks the index for "the first value after the previous one"
    reads one row per value (PostgreSQL and SQLite both plan each step as a one-row index
    scan). ``first(*args)`` builds the queryset of the first value (ordered by the
    column, ``values_list(column)[:1]``) and ``after(*args, previous)`` the same with
    ``column > previous``; both are compiled as ``PreparedQuery`` does, so the filters
    stay the querysets'. ``rows(using, *args, limit=, offset=)`` returns the values, as
    ``distinct`` (the plain ``DISTINCT`` query) would; an argument no placeholder stands
    for runs ``distinct`` itself.
    """

    def __init__(self, first: Callable[..., QuerySet], after: Callable[..., QuerySet], distinct: PreparedQuery) -> None:
        super().__init__()
        self.first, self.after, self.distinct = PreparedQuery(first), PreparedQuery(after), distinct

    def _compile(self, using: str, args: tuple[Any, ...], shape: dict[str, Hashable]) -> _Scan:
        first = self.first.compiled(using, args, {})
        after = self.after.compiled(using, (*args, ""), {})
        assert first is not None and after is not None  # the same argument types compile
        limit, offset = cast(int, shape["limit"]), cast(int, shape["offset"])
        return _Scan(first, after, len(args), using, limit, offset)

    def _uncompiled(self, using: str, args: tuple[Any, ...], shape: dict[str, Hashable]) -> list[tuple[Any, ...]]:
        return self.distinct.rows(using, *args, **shape)


@contextlib.contextmanager
def planned_each_time(using: str) -> Iterator[None]:
    """Run the statements of the block on ``using`` unprepared, so each is planned for its own values.

    For a statement whose right plan depends on its values: on a connection that prepares
    (psycopg's ``prepare_threshold``, README "Prepared statements on Django's connection"),
    PostgreSQL soon runs a prepared statement on a generic plan made for any values, and
    with one user owning most rows, the plan that suits the others reads all of that
    user's. Planning again costs a millisecond or two. Elsewhere this does nothing.
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        yield
        return
    connection.ensure_connection()
    psycopg_connection = connection.connection
    threshold = psycopg_connection.prepare_threshold
    psycopg_connection.prepare_threshold = None
    try:
        yield
    finally:
        psycopg_connection.prepare_threshold = threshold
