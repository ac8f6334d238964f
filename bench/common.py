"""What the workloads share: the interleaved measurement loop and Django helpers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

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
    """Time every SQL statement Django runs on ``connection`` (``execute_wrapper``)."""

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
        self._cm = self.conn.execute_wrapper(self)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)

    @property
    def longest(self) -> tuple[float, str]:
        return max(self.statements, default=(0.0, ""))


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
