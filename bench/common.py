"""What the workloads share: the interleaved measurement loop and Django helpers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any
from unittest import mock

from django.db import connection, connections

from .measure import MODES, Result, Round, run_async, run_sync, summarize

log = logging.getLogger("bench")

#: The bench database's alias with server-side binding and prepared statements (bench/settings.py).
PREPARED_ALIAS = "prepared"


async def compare_async(
    workload: str,
    case: str,
    impls: dict[str, Callable[[int], Any]],
    *,
    sync: tuple[str, ...] = (),
    contexts: dict[str, Callable[[], Any]] | None = None,
    ops: int,
    rounds: int,
    warmup: int = 50,
    modes: dict[str, int] = MODES,
    round_seconds: float = 1.5,
    **extra: Any,
) -> list[Result]:
    """Measure ``case`` of every implementation, alternating them round by round.

    The order of the implementations rotates each round, so none always runs first
    (on a warmer cache) or last. Each round uses fresh operation indices. Implementations
    named in ``sync`` are plain functions, called from threads (one Django connection each);
    those named in ``contexts`` run each caller inside a fresh context of that factory.
    """
    contexts = contexts or {}

    async def one(name: str, ops: int, concurrency: int, start: int) -> Round:
        if name in sync:
            return sync_threads_round(impls[name], ops, concurrency, start)
        return await run_async(impls[name], ops, concurrency, start=start, context=contexts.get(name))

    names = list(impls)
    per_round: dict[str, int] = {}
    for name in names:
        warm = await one(name, warmup, 1, 10_000_000)
        # A slow implementation gets fewer calls per round (at least 20), so one round
        # lasts about ``round_seconds`` whatever its speed; the rate stays per second.
        per_op = warm.seconds / max(len(warm.latencies), 1)
        per_round[name] = max(min(ops, int(round_seconds / per_op) if per_op else ops), min(20, ops))
    results = []
    for mode, concurrency in modes.items():
        got: dict[str, list[Round]] = {n: [] for n in names}
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                start = (r + 1) * 1_000_000 + (concurrency * 100_000)
                got[name].append(await one(name, per_round[name], concurrency, start))
        for name in names:
            res = summarize(workload, case, name, mode, got[name], **extra)
            log.info(
                "  %-10s %-16s %-30s %-4s %9.0f ops/s  p50 %7.2f ms  p99 %7.2f ms",
                workload,
                case,
                name,
                mode,
                res.ops_per_s,
                res.p50_ms,
                res.p99_ms,
            )
            results.append(res)
    return results


def sync_threads_round(op: Callable[[int], Any], ops: int, concurrency: int, start: int) -> Round:
    """Run a sync Django operation from ``concurrency`` threads, each on its own connection."""
    return run_sync(
        op, ops, concurrency, start=start, setup=lambda: connection.ensure_connection(), teardown=connections.close_all
    )


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


class StatementTimer:
    """Time every statement Django's ``connection`` sends the server while the block runs.

    ``execute_wrapper`` sees the statements Django executes (a server-side cursor's DECLARE
    among them; psycopg sends a transaction's BEGIN with its first statement). The round
    trips that bypass it are timed too: each FETCH and the CLOSE of a server-side cursor
    (what ``QuerySet.iterator()`` streams through on PostgreSQL), and each COMMIT. Times are
    the client's: a statement's round trip, and any pause of this process while it waits.
    """

    def __init__(self, conn: Any = None) -> None:
        self.conn = conn or connection
        self.statements: list[tuple[float, str]] = []

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            self.statements.append((time.perf_counter() - t0, sql))

    def __enter__(self) -> StatementTimer:
        import psycopg
        from psycopg.pq import TransactionStatus

        self.conn.ensure_connection()
        mine = self.conn.connection  # the psycopg connection under Django's

        def in_transaction(conn: psycopg.Connection) -> bool:
            # Without a transaction open, COMMIT and CLOSE send nothing (psycopg returns at once).
            return conn.info.transaction_status == TransactionStatus.INTRANS

        def timing(cls: type, method: str, label: str, connection_of: Callable[[Any], Any]) -> Any:
            original = getattr(cls, method)

            def timed(obj: Any, *args: Any, **kwargs: Any) -> Any:
                conn = connection_of(obj)
                if conn is not mine or not in_transaction(conn):
                    return original(obj, *args, **kwargs)
                t0 = time.perf_counter()
                try:
                    return original(obj, *args, **kwargs)
                finally:
                    self.statements.append((time.perf_counter() - t0, label))

            return mock.patch.object(cls, method, timed)

        # psycopg has no hook for fetches and commits: its classes are patched for the block,
        # and only this connection's calls are timed (another thread's go through untouched).
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self.conn.execute_wrapper(self))
        for method in ("fetchone", "fetchmany", "fetchall"):
            self._stack.enter_context(timing(psycopg.ServerCursor, method, "FETCH", lambda c: c.connection))
        self._stack.enter_context(timing(psycopg.ServerCursor, "close", "CLOSE", lambda c: c.connection))
        self._stack.enter_context(timing(psycopg.Connection, "commit", "COMMIT", lambda c: c))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    @property
    def longest(self) -> tuple[float, str]:
        return max(self.statements, default=(0.0, ""))

    def transactions(self) -> list[float]:
        """Return the time of each transaction: its statements' times, up to and including its COMMIT."""
        out, current = [], 0.0
        for seconds, sql in self.statements:
            current += seconds
            if sql == "COMMIT":
                out.append(current)
                current = 0.0
        return out


def check_replayed_sql(who: str, statements: dict[str, str], calls: Callable[[], Any]) -> list[str]:
    """Fail unless ``calls()`` sends each raw-side statement (the text around its parameters, in order).

    The raw psycopg rows replay afkmemory's own SQL; this keeps them honest when it changes.
    Returns the statements sent.
    """
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        calls()
    sent = [q["sql"] for q in captured.captured_queries]
    for name, sql in statements.items():
        if not any(_same_statement(statement, sql) for statement in sent):
            raise AssertionError(f"{who} no longer sends the {name!r} statement the raw side replays: {sent}")
    return sent


def _same_statement(sent: str, sql: str) -> bool:
    """Whether ``sent`` (parameters filled in, as Django logs it) is ``sql`` (``%s`` placeholders)."""
    pieces = sql.split("%s")
    if not (sent.startswith(pieces[0]) and sent.endswith(pieces[-1])):
        return False
    position = len(pieces[0])
    for piece in pieces[1:]:
        found = sent.find(piece, position)
        if found < 0:
            return False
        position = found + len(piece)
    return True


def psql(sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run one statement on Django's connection and return its rows (if any)."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def own_sync_thread() -> Any:
    """afkmemory's ``own_thread()``, with the caller's connection opened before timing starts.

    Outside a request, every thread-sensitive ``sync_to_async`` call of the process shares
    one thread, so concurrent callers of an async Django store queue behind each other;
    ``own_thread`` gives each its own thread and connection, as Django's ASGI handler does.
    """
    from asgiref.sync import sync_to_async

    from afkmemory.stores import own_thread

    async with own_thread():
        await sync_to_async(lambda: connection.ensure_connection())()
        yield


@contextlib.contextmanager
def calls_meanwhile(op: Callable[[int], Any], *, every: float = 0.01) -> Any:
    """Call ``op(i)`` from a thread of its own (and so a connection of its own) while the block runs.

    One call every ``every`` seconds (100 a second by default: an agent's pace, light enough
    not to slow the job in the block much). ``op(0)`` runs before the block, untimed, to
    open the connection and warm up; the block gets the list the latencies (seconds) of the
    calls from ``op(1)`` on go into.
    """
    latencies: list[float] = []
    ready, stop = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def loop() -> None:
        try:
            op(0)
            ready.set()
            i = 1
            while not stop.is_set():
                t0 = time.perf_counter()
                op(i)
                latencies.append(time.perf_counter() - t0)
                i += 1
                stop.wait(every)
        except BaseException as exc:
            failed.append(exc)
        finally:
            ready.set()
            connections.close_all()  # this thread's connections

    thread = threading.Thread(target=loop, name="calls-meanwhile")
    thread.start()
    ready.wait()
    try:
        yield latencies
    finally:
        stop.set()
        thread.join()
    if failed:
        raise failed[0]


def latency_summary(latencies: list[float]) -> dict[str, float]:
    """Return the count, p50, p99 and max (ms) of ``latencies`` (seconds)."""
    import numpy as np

    ms = np.array(latencies) * 1000.0
    if not len(ms):
        return {"calls": 0}
    return {
        "calls": len(ms),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "max_ms": round(float(ms.max()), 2),
    }
