"""The async stores' own connections on PostgreSQL, a few per event loop, with no thread hop.

By default every async store call is a ``sync_to_async`` hop into its sync store, whose
queries run on Django's connection of that thread (concurrent calls share hops:
``concurrency``).
With ``AFKMEMORY["ASYNC_POOL"] = True`` (or a store's ``async_pool=True``), the hot calls
on a PostgreSQL alias instead send their statement from the event loop, on up to
``ASYNC_POOL_SIZE`` psycopg ``AsyncConnection``s per event loop and alias: no thread hop per
call, and concurrent callers each get a connection instead of queueing on one thread.
Connections open on demand, are reused, and close with their event loop (``asyncio.run``
and ``async_to_sync`` make a loop per call) or on ``close_async_pools()``.

The hot calls are ``DjangoStore.get``, ``put``, ``search`` and ``list_namespaces``, and
``DjangoMemoryStore.append_event`` (into an existing thread), ``get_recent_events``,
``get_state`` (of a plain key) and ``search_long_term_memory_vector`` (its query vector
sent in binary, ``Vector``); the others hop as before.

``get`` and ``put`` are also *batched* (``batched``): the calls that concurrent callers
make in one turn of the event loop go to the database as one statement, a ``SELECT`` of
every key asked or a multi-row upsert, as LangGraph's ``AsyncBatchedBaseStore`` does.
With one caller a batch holds one call; with many, one round trip and one commit serve
them all. Each caller still gets its own answer, or its own error: a batch that fails is
sent again call by call.

The connections are the alias's own: Django's connection parameters (``OPTIONS``
included), its adapters (the same Python values come back), its time zone and
``assume_role``; errors are raised as Django's (``django.db.IntegrityError`` and so on).
The stores' statements, a fixed few, go with server-side binding as prepared statements
(parsed and planned once per connection, as asyncpg does for agentflow's store), unless
``ASYNC_POOL_PREPARE`` is False (PgBouncer before 1.21 in transaction mode cannot route
them); ``connection()`` hands out Django's cursor, client-side binding unless
``server_side_binding`` is set.

The connections run in autocommit, each statement committing itself, so they are not
part of any Django transaction: rows that a transaction has not committed yet, including
a ``TestCase``'s, are invisible to them, and what they write does not roll back with it.
Async code cannot hold a Django transaction across ``await`` anyway; tests that rely on
``TestCase`` isolation should leave the pool off.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from django.db import connections
from django.utils import timezone

from ..conf import afk_settings
from ..memory import loops
from .concurrency import hop
from .prepared import DistinctScan, PreparedQuery, native_timestamp_loader, vendor

if TYPE_CHECKING:
    from psycopg import AsyncConnection, AsyncCursor

__all__ = ["Vector", "batched", "check_choice", "close_async_pools", "pooled"]

#: The most calls one batched statement answers; more start the next batch.
MAX_BATCH = 64

#: A statement's parameters, or a function that makes them once it has a connection.
Params: TypeAlias = list[Any] | Callable[[], list[Any]]


class _Now:
    __slots__ = ()

    def __repr__(self) -> str:
        return "asyncpool.NOW"


#: An argument of ``rows`` that is the time its statement goes out, read once it has a
#: connection: an item that expires while a read waits for one is not returned.
NOW = _Now()


def pooled(using: str, choice: bool | None = None) -> bool:
    """Whether an async store's hot calls on ``using`` go through the pool.

    ``choice`` is the store's ``async_pool`` argument; None follows ``ASYNC_POOL``. Only
    PostgreSQL aliases have the pool; on others the stores always hop.
    """
    wanted = afk_settings.ASYNC_POOL if choice is None else choice
    return bool(wanted) and vendor(using) == "postgresql"


def check_choice(using: str, choice: Any) -> bool | None:
    """Validate a store's ``async_pool`` argument: None, or a bool that True only on PostgreSQL."""
    if choice is not None and not isinstance(choice, bool):
        raise TypeError(f"async_pool must be True, False or None (the ASYNC_POOL setting), got {choice!r}")
    if choice and vendor(using) != "postgresql":
        raise ValueError(f"async_pool=True needs PostgreSQL; database {using!r} is {vendor(using)}")
    return choice


class _Pool:
    """Up to ``ASYNC_POOL_SIZE`` autocommit connections to one alias for one event loop.

    Callers beyond the size wait for a connection. An idle connection is reused unless
    psycopg saw it break; one returned mid-transaction (a cancelled call) is closed.
    There are no background tasks (psycopg_pool's would be cancelled by ``asyncio.run``
    before the loop closes, and its ``close()`` then fails): connections open on demand
    and close with ``close()``.
    """

    def __init__(self, using: str) -> None:
        from psycopg import AsyncClientCursor, AsyncCursor

        # Not connections[using] (the loop thread's, kept in the caller's context: see
        # prepared.builder): a wrapper of its own, read for settings as they are now.
        wrapper = connections.create_connection(using)
        options = wrapper.settings_dict["OPTIONS"]
        self.params = wrapper.get_connection_params()  # Django's: dbname, user, ..., adapters, prepare_threshold
        binding = options.get("server_side_binding") is True
        self.params["cursor_factory"] = AsyncCursor if binding else AsyncClientCursor
        self.params["autocommit"] = True
        self.timezone_name = wrapper.timezone_name
        self.role = options.get("assume_role")
        self.errors = wrapper.wrap_database_errors  # psycopg's exceptions raised as Django's
        self.prepare = afk_settings.ASYNC_POOL_PREPARE
        if self.prepare and self.params.get("prepare_threshold") is None:
            # psycopg prepares nothing, not even on request, without a threshold; one no query
            # reaches keeps your own statements (``connection()``) as Django's OPTIONS has them.
            self.params["prepare_threshold"] = 2**62
        self.slots = asyncio.Semaphore(afk_settings.ASYNC_POOL_SIZE)
        self.idle: list[AsyncConnection] = []
        self.closed = False
        self.batches: dict[Hashable, _Batch] = {}  # the open batch of each kind
        self.flying: dict[Hashable, list[_Batch]] = {}  # the batches of each kind on their way, oldest first
        self.sending: set[asyncio.Task[None]] = set()  # batches on their way (a task needs a reference)

    async def _connect(self) -> AsyncConnection:
        """A new connection, set up as Django sets up its own (``DatabaseWrapper._configure_connection``)."""
        from psycopg import AsyncConnection, sql

        conn = await AsyncConnection.connect(**self.params)
        try:
            if self.timezone_name and conn.info.parameter_status("TimeZone") != self.timezone_name:
                await conn.execute("SELECT set_config('TimeZone', %s, false)", [self.timezone_name])
            if self.role:
                await conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(self.role)))
            conn.adapters.register_dumper(Vector, _vector_dumper())
            native_timestamp_loader(conn.adapters)  # psycopg's compiled loader, not Django's
        except BaseException:
            await conn.close()
            raise
        return conn

    async def acquire(self) -> AsyncConnection:
        """Wait for a slot, then return an idle connection or a new one; pair with ``give_back``.

        A failure to connect (the server down, a bad ``assume_role``) is Django's error.
        """
        await self.slots.acquire()
        try:
            while self.idle:
                conn = self.idle.pop()
                if _usable(conn):
                    return conn
                await conn.close()
            with self.errors:
                return await self._connect()
        except BaseException:
            self.slots.release()
            raise

    async def give_back(self, conn: AsyncConnection) -> None:
        """Keep ``conn`` for the next caller, unless it is closed, broken or left inside a transaction."""
        try:
            if self.closed or not _usable(conn):  # e.g. a call cancelled mid-statement
                await conn.close()
            else:
                self.idle.append(conn)
        finally:
            self.slots.release()

    async def run(self, sql: str, params: Params, *, fetch: bool) -> tuple[list[tuple[Any, ...]], int]:
        """Send one statement; return its rows (if ``fetch``) and its row count, with Django's errors.

        ``params`` may be a function that makes them, called once the statement has a
        connection (a put's clock: see ``items._Put``).

        A statement prepared before a migration changed a column's type fails on that
        connection, every time ("cached plan must not change result type"), before it
        runs: the connection is closed and the statement sent once more on another, which
        prepares it afresh.
        """
        from psycopg.errors import FeatureNotSupported

        for attempt in range(2):
            conn = await self.acquire()
            try:
                with self.errors:
                    try:
                        cursor = await self.send(conn, sql, params() if callable(params) else params)
                    except FeatureNotSupported as error:
                        if attempt or "cached plan must not change result type" not in str(error):
                            raise
                        await conn.close()  # ``give_back`` then drops it
                        continue
                    return (await cursor.fetchall() if fetch else []), cursor.rowcount
            finally:
                await self.give_back(conn)
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def send(self, conn: AsyncConnection, sql: str, params: list[Any]) -> AsyncCursor[Any]:
        """Execute one statement on ``conn`` with server-side binding, prepared unless ``ASYNC_POOL_PREPARE`` is off."""
        from psycopg import AsyncCursor

        cursor = AsyncCursor(conn)
        await cursor.execute(sql, params, prepare=self.prepare)
        return cursor

    async def close(self) -> None:
        self.closed = True
        idle, self.idle = self.idle, []
        for conn in idle:
            await conn.close()


class _Batch:
    """Calls of one kind waiting for the statement that answers them all."""

    def __init__(self, send: Callable[[list[Any]], Awaitable[Sequence[Any]]]) -> None:
        self.send = send
        self.calls: list[Any] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.unique: set[Hashable] = set()
        self.finished = asyncio.Event()  # answered (or failed), resends included

    async def answer(self) -> None:
        """Send the calls as one statement and hand each caller its answer.

        If the statement fails, each call is sent alone, so that only the callers whose
        own call fails get an error (and a deadlock between two batches clears itself).
        No caller is left waiting: if answering fails or is cancelled, so are they.
        """
        try:
            results = await self._results()
        except BaseException as error:
            for future in self.futures:
                if future.done():
                    continue
                if isinstance(error, Exception):  # a bug in ``send``: say so to the callers
                    future.set_exception(error)
                else:  # cancelled (the loop is shutting down): so are they
                    future.cancel()
            if not isinstance(error, Exception):
                raise
            return
        for future, result in zip(self.futures, results, strict=True):
            if future.done():  # its caller was cancelled
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _results(self) -> Sequence[Any]:
        """One answer (or exception) per call."""
        try:
            results = await self.send(self.calls)
            if len(results) != len(self.calls):
                raise RuntimeError(f"a batch of {len(self.calls)} calls got {len(results)} answers")
            return results
        except Exception as error:
            if len(self.calls) == 1:
                return [error]
            return await asyncio.gather(*(self._alone(call) for call in self.calls))

    async def _alone(self, call: Any) -> Any:
        try:
            [result] = await self.send([call])
        except Exception as error:
            return error
        return result


def _usable(conn: AsyncConnection) -> bool:
    """Open, healthy, outside a transaction and in autocommit (``connection()`` users may turn it off).

    libpq says UNKNOWN for a closed or broken connection.
    """
    from psycopg.pq import TransactionStatus

    return conn.pgconn.transaction_status == TransactionStatus.IDLE and conn.autocommit


class _Pools(dict[str, _Pool]):
    """One event loop's pools, by alias; kept on the loop (``loops.held``), closed with it."""

    async def aclose(self) -> None:
        closing = list(self.values())
        self.clear()
        for pool in closing:
            await pool.close()


def _pools(loop: asyncio.AbstractEventLoop) -> _Pools:
    held = loops.held(loop)
    pools = held.get(_Pools)
    if pools is None:
        pools = held[_Pools] = _Pools()
    return cast(_Pools, pools)


def _pool(using: str) -> _Pool:
    pools = _pools(asyncio.get_running_loop())
    pool = pools.get(using)
    if pool is None:
        pool = pools[using] = _Pool(using)
    return pool


async def close_async_pools() -> None:
    """Close the running event loop's connections (they also close with their loop)."""
    await _pools(asyncio.get_running_loop()).aclose()


@asynccontextmanager
async def connection(using: str) -> AsyncIterator[AsyncConnection]:
    """A pooled autocommit connection to ``using``, for statements of your own; Django's errors.

    It holds one of the loop's ``ASYNC_POOL_SIZE`` slots until the block ends: a pooled
    store call awaited inside waits for another slot (forever, if every one is so held).
    """
    pool = _pool(using)
    conn = await pool.acquire()
    try:
        with pool.errors:
            yield conn
    finally:
        await pool.give_back(conn)


async def fetch(using: str, sql: str, params: Params) -> list[tuple[Any, ...]]:
    """Run one statement that returns rows; return them."""
    return (await _pool(using).run(sql, params, fetch=True))[0]


async def execute(using: str, sql: str, params: Params) -> int:
    """Run one statement; return its row count."""
    return (await _pool(using).run(sql, params, fetch=False))[1]


class Vector:
    """A pgvector ``vector`` parameter of the pool's statements (written ``%s::vector``).

    It goes in pgvector's binary form, float32 as stored: no decimal text to format
    (about 0.1 ms for 384 numbers) and none for the server to parse.
    """

    __slots__ = ("values",)

    def __init__(self, values: Sequence[float]) -> None:
        self.values = values


@functools.cache
def _vector_dumper() -> type:
    import numpy as np
    from psycopg.adapt import Dumper
    from psycopg.pq import Format

    class VectorDumper(Dumper):
        # No type oid: the server takes the parameter's type from its ``::vector`` cast and
        # reads these bytes with vector's binary input (uint16 dimensions, uint16 0, float32s).
        format = Format.BINARY

        def dump(self, obj: Vector) -> bytes:
            values = np.asarray(obj.values, dtype=">f4")
            return len(values).to_bytes(2, "big") + b"\0\0" + values.tobytes()

    return VectorDumper


async def batched(
    using: str,
    kind: Hashable,
    call: Any,
    send: Callable[[list[Any]], Awaitable[Sequence[Any]]],
    *,
    unique: Hashable | None = None,
) -> Any:
    """Answer ``call`` together with the other calls of ``kind`` made in this turn of the loop.

    The first call of a kind opens a batch and schedules it; the calls made before the
    loop gets to it (other callers that woke in the same turn) join, up to ``MAX_BATCH``.
    Then ``send(calls)`` runs once, on the pool, and returns one answer per call, in
    order. ``kind`` must name everything ``send`` depends on (the operation, the
    database, the owner): calls of one kind share the first call's ``send``. A call whose
    ``unique`` key is already in the open batch starts the next one (two writes of one
    row cannot share an upsert), which is sent once every earlier batch with that key is
    answered: writes of one row land in the order they were made.
    """
    pool = _pool(using)
    batch = pool.batches.get(kind)
    if batch is None or len(batch.calls) >= MAX_BATCH or (unique is not None and unique in batch.unique):
        batch = pool.batches[kind] = _Batch(send)
        task = asyncio.get_running_loop().create_task(_close_and_answer(pool, kind, batch))
        pool.sending.add(task)
        task.add_done_callback(pool.sending.discard)
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    batch.calls.append(call)
    batch.futures.append(future)
    if unique is not None:
        batch.unique.add(unique)
    return await future


async def _close_and_answer(pool: _Pool, kind: Hashable, batch: _Batch) -> None:
    """Close ``batch`` to later calls and answer it, after the earlier batches that write one of its rows.

    Two puts of one key go in two batches, on two connections: without the wait the later
    one could commit first (or the earlier one be resent after it) and the earlier value
    win, where calls that hop are made in order.
    """
    if pool.batches.get(kind) is batch:  # later calls open the next batch
        del pool.batches[kind]
    flying = pool.flying.setdefault(kind, [])
    earlier = [other for other in flying if other.unique & batch.unique]
    flying.append(batch)
    try:
        for other in earlier:
            await other.finished.wait()
        await batch.answer()
    except BaseException:  # cancelled while it waited for an earlier batch: answer() never ran
        for future in batch.futures:
            if not future.done():
                future.cancel()
        raise
    finally:
        flying.remove(batch)
        if not flying:
            del pool.flying[kind]
        batch.finished.set()


async def rows(query: PreparedQuery | DistinctScan, using: str, *args: Any, **shape: Hashable) -> list[tuple[Any, ...]]:
    """``query.rows(using, *args, **shape)`` on the pool.

    Compiling a statement the first time may read the database's features, so that
    happens once on Django's side; an argument no placeholder stands for runs the
    queryset there too. An argument ``NOW`` is the time the statement goes out.
    """
    now_at = [i for i, arg in enumerate(args) if arg is NOW]
    if now_at:  # a datetime to choose and compile the statement by, read again as it goes out
        args = _now_at(args, now_at)
    compiled = query.cached(using, args, shape)
    if compiled is None:
        compiled = await hop(type(query).compiled)(query, using, args, shape)
        if compiled is None:
            return await hop(type(query).rows)(query, using, *args, **shape)
    if not compiled.sql:
        return []
    params: Params = (lambda: compiled.bind(_now_at(args, now_at))) if now_at else compiled.bind(args)
    return compiled.convert(await fetch(using, compiled.sql, params))


def _now_at(args: tuple[Any, ...], positions: list[int]) -> tuple[Any, ...]:
    """``args`` with the time now at ``positions`` (where ``rows`` was given ``NOW``)."""
    now = timezone.now()
    return tuple(now if i in positions else arg for i, arg in enumerate(args))
