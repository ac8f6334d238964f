"""The async stores' own connections on PostgreSQL, a few per event loop, with no thread hop.

By default every async store call is one ``sync_to_async`` hop into its sync store, whose
queries run on Django's connection of that thread.
With ``AFKMEMORY["ASYNC_POOL"] = True`` (or a store's ``async_pool=True``), the hot calls
on a PostgreSQL alias instead send their statement from the event loop, on up to
``ASYNC_POOL_SIZE`` psycopg ``AsyncConnection``s per event loop and alias: no thread hop per
call, and concurrent callers each get a connection instead of queueing on one thread.
Connections open on demand, are reused, and close with their event loop (``asyncio.run``
and ``async_to_sync`` make a loop per call) or on ``close_async_pools()``.

The hot calls are ``DjangoStore.get``, ``put``, ``search`` and ``list_namespaces``, and
``DjangoMemoryStore.append_event`` (into an existing thread), ``get_recent_events`` and
``get_state`` (of a plain key); the others hop as before.

The connections are the alias's own: Django's connection parameters (``OPTIONS``
included), its adapters (the same Python values come back), its time zone and
``assume_role``, client-side binding unless ``server_side_binding`` is set; errors are
raised as Django's (``django.db.IntegrityError`` and so on). They run in autocommit, each
statement committing itself, so they are not part of any Django transaction: rows that a
transaction has not committed yet, including a ``TestCase``'s, are invisible to them, and
what they write does not roll back with it. Async code cannot hold a Django transaction
across ``await`` anyway; tests that rely on ``TestCase`` isolation should leave the pool off.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from django.db import connections

from ..conf import afk_settings
from ..memory.loops import release_on_close
from .concurrency import hop
from .prepared import DistinctScan, PreparedQuery

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = ["check_choice", "close_async_pools", "pooled"]


def pooled(using: str, choice: bool | None = None) -> bool:
    """Whether an async store's hot calls on ``using`` go through the pool.

    ``choice`` is the store's ``async_pool`` argument; None follows ``ASYNC_POOL``. Only
    PostgreSQL aliases have the pool; on others the stores always hop.
    """
    wanted = afk_settings.ASYNC_POOL if choice is None else choice
    return bool(wanted) and connections[using].vendor == "postgresql"


def check_choice(using: str, choice: Any) -> bool | None:
    """Validate a store's ``async_pool`` argument: None, or a bool that True only on PostgreSQL."""
    if choice is not None and not isinstance(choice, bool):
        raise TypeError(f"async_pool must be True, False or None (the ASYNC_POOL setting), got {choice!r}")
    if choice and connections[using].vendor != "postgresql":
        raise ValueError(f"async_pool=True needs PostgreSQL; database {using!r} is {connections[using].vendor}")
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

        wrapper = connections[using]
        options = wrapper.settings_dict["OPTIONS"]
        self.params = wrapper.get_connection_params()  # Django's: dbname, user, ..., adapters, prepare_threshold
        binding = options.get("server_side_binding") is True
        self.params["cursor_factory"] = AsyncCursor if binding else AsyncClientCursor
        self.params["autocommit"] = True
        self.timezone_name = wrapper.timezone_name
        self.role = options.get("assume_role")
        self.errors = wrapper.wrap_database_errors  # psycopg's exceptions raised as Django's
        self.slots = asyncio.Semaphore(afk_settings.ASYNC_POOL_SIZE)
        self.idle: list[AsyncConnection] = []
        self.closed = False

    async def _connect(self) -> AsyncConnection:
        """A new connection, set up as Django sets up its own (``DatabaseWrapper._configure_connection``)."""
        from psycopg import AsyncConnection, sql

        conn = await AsyncConnection.connect(**self.params)
        try:
            if self.timezone_name and conn.info.parameter_status("TimeZone") != self.timezone_name:
                await conn.execute("SELECT set_config('TimeZone', %s, false)", [self.timezone_name])
            if self.role:
                await conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(self.role)))
        except BaseException:
            await conn.close()
            raise
        return conn

    async def acquire(self) -> AsyncConnection:
        """Wait for a slot, then return an idle connection or a new one; pair with ``give_back``."""
        await self.slots.acquire()
        try:
            while self.idle:
                conn = self.idle.pop()
                if _usable(conn):
                    return conn
                await conn.close()
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

    async def run(self, sql: str, params: list[Any], *, fetch: bool) -> tuple[list[tuple[Any, ...]], int]:
        """Send one statement; return its rows (if ``fetch``) and its row count, with Django's errors."""
        conn = await self.acquire()
        try:
            with self.errors:
                cursor = await conn.execute(sql, params)
                return (await cursor.fetchall() if fetch else []), cursor.rowcount
        finally:
            await self.give_back(conn)

    async def close(self) -> None:
        self.closed = True
        idle, self.idle = self.idle, []
        for conn in idle:
            await conn.close()


def _usable(conn: AsyncConnection) -> bool:
    """Open, healthy and outside a transaction: libpq says UNKNOWN for a closed or broken connection."""
    from psycopg.pq import TransactionStatus

    return conn.pgconn.transaction_status == TransactionStatus.IDLE


_pools: dict[asyncio.AbstractEventLoop, dict[str, _Pool]] = {}


async def _release(loop: asyncio.AbstractEventLoop) -> None:
    for pool in _pools.pop(loop, {}).values():
        await pool.close()


def _pool(using: str) -> _Pool:
    loop = asyncio.get_running_loop()
    pools = _pools.get(loop)
    if pools is None:
        for old in [old for old in _pools if old.is_closed()]:  # loops whose close could not be hooked
            del _pools[old]
        pools = _pools[loop] = {}
        release_on_close(loop, functools.partial(_release, loop))
    pool = pools.get(using)
    if pool is None:
        pool = pools[using] = _Pool(using)
    return pool


async def close_async_pools() -> None:
    """Close the running event loop's connections (they also close with their loop)."""
    await _release(asyncio.get_running_loop())


@asynccontextmanager
async def connection(using: str) -> AsyncIterator[AsyncConnection]:
    """A pooled autocommit connection to ``using``, for statements of your own; Django's errors."""
    pool = _pool(using)
    conn = await pool.acquire()
    try:
        with pool.errors:
            yield conn
    finally:
        await pool.give_back(conn)


async def fetch(using: str, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    """Run one statement that returns rows; return them."""
    return (await _pool(using).run(sql, params, fetch=True))[0]


async def execute(using: str, sql: str, params: list[Any]) -> int:
    """Run one statement; return its row count."""
    return (await _pool(using).run(sql, params, fetch=False))[1]


async def rows(query: PreparedQuery | DistinctScan, using: str, *args: Any, **shape: Hashable) -> list[tuple[Any, ...]]:
    """``query.rows(using, *args, **shape)`` on the pool.

    Compiling a statement the first time may read the database's features, so that
    happens once on Django's side; an argument no placeholder stands for runs the
    queryset there too.
    """
    compiled = query.cached(using, args, shape)
    if compiled is None:
        compiled = await hop(type(query).compiled)(query, using, args, shape)
        if compiled is None:
            return await hop(type(query).rows)(query, using, *args, **shape)
    if not compiled.sql:
        return []
    return compiled.convert(await fetch(using, compiled.sql, compiled.bind(args)))
