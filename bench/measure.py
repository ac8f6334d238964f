"""Timing: throughput and latency percentiles of an operation, sequential or concurrent.

Each measurement is a *round*: ``ops`` calls spread over ``concurrency`` callers, timed
one by one with ``perf_counter``. ``bench.run`` alternates the implementations round by
round, so drift of the shared machine hits all of them alike, and reports the median
round's throughput and the percentiles of all rounds' latencies pooled.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

AsyncOp = Callable[[int], Awaitable[Any]]
SyncOp = Callable[[int], Any]


@dataclass
class Round:
    seconds: float
    latencies: list[float]

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0


@dataclass
class Result:
    """One row of a table: an operation of one implementation in one mode."""

    workload: str
    case: str
    impl: str
    mode: str  # "seq" or "c8"
    ops_per_s: float
    p50_ms: float
    p99_ms: float
    ops: int
    rounds: int
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(workload: str, case: str, impl: str, mode: str, rounds: list[Round], **extra: Any) -> Result:
    """Return the median round's rate and the pooled latency percentiles."""
    pooled = np.array([lat for r in rounds for lat in r.latencies]) * 1000.0
    return Result(
        workload=workload,
        case=case,
        impl=impl,
        mode=mode,
        ops_per_s=statistics.median(r.rate for r in rounds),
        p50_ms=float(np.percentile(pooled, 50)) if len(pooled) else 0.0,
        p99_ms=float(np.percentile(pooled, 99)) if len(pooled) else 0.0,
        ops=len(pooled),
        rounds=len(rounds),
        extra=extra,
    )


async def run_async(
    op: AsyncOp, ops: int, concurrency: int, *, start: int = 0, context: Callable[[], Any] | None = None
) -> Round:
    """Call ``op(i)`` for ``i`` in ``start .. start+ops-1`` from ``concurrency`` coroutines.

    ``context``, if given, makes an async context manager each caller runs inside (for
    asgiref's ``ThreadSensitiveContext``: one sync thread, and one connection, per caller).
    The round is timed from the moment every caller has entered its context (a barrier)
    until the last call returns: making threads and connections, and closing them, is not
    what is measured.
    """
    counter = iter(range(start, start + ops))
    latencies: list[float] = []
    barrier = asyncio.Barrier(concurrency)
    started: float | None = None
    ends: list[float] = []

    async def calls() -> None:
        nonlocal started
        await barrier.wait()
        if started is None:  # the first caller released starts the clock, before any call
            started = time.perf_counter()
        for i in counter:
            t0 = time.perf_counter()
            await op(i)
            latencies.append(time.perf_counter() - t0)
        ends.append(time.perf_counter())

    async def caller() -> None:
        async with context() if context else contextlib.nullcontext():
            await calls()

    # A TaskGroup: if one caller fails (entering its context, say), the others, waiting at
    # the barrier, are cancelled instead of waiting for it forever.
    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(caller())
    assert started is not None
    return Round(max(ends) - started, latencies)


def run_sync(
    op: SyncOp,
    ops: int,
    concurrency: int,
    *,
    start: int = 0,
    setup: Callable[[], Any] | None = None,
    teardown: Callable[[], Any] | None = None,
) -> Round:
    """Call ``op(i)`` from ``concurrency`` threads; each runs ``setup`` before and ``teardown`` after, untimed.

    The round is timed from the moment every thread is set up (a barrier) until the last
    call returns.
    """
    lock = threading.Lock()
    counter = iter(range(start, start + ops))
    latencies: list[float] = []
    ends: list[float] = []
    started: list[float] = []
    # The barrier's action runs once, in one thread, after all arrive and before any goes on.
    barrier = threading.Barrier(concurrency, action=lambda: started.append(time.perf_counter()))

    def next_index() -> int | None:
        with lock:
            return next(counter, None)

    def caller() -> None:
        try:
            if setup:
                setup()
            barrier.wait()
            mine = []
            while (i := next_index()) is not None:
                t0 = time.perf_counter()
                op(i)
                mine.append(time.perf_counter() - t0)
            end = time.perf_counter()
            with lock:
                latencies.extend(mine)
                ends.append(end)
        except BaseException:
            barrier.abort()  # the others stop waiting for this thread
            raise
        finally:
            if teardown:
                teardown()

    threads = [threading.Thread(target=caller) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(ends) < concurrency:
        raise RuntimeError(f"{concurrency - len(ends)} of {concurrency} threads failed (see their tracebacks above)")
    return Round(max(ends) - started[0], latencies)


@dataclass
class Scale:
    """The sizes of one run: the full run's or the smoke run's."""

    smoke: bool
    rounds: int
    # store
    store_items: int
    store_ops: int
    # memory
    thread_events: int
    memory_ops: int
    # vector
    vectors: int
    vector_users: int
    vector_dims: int
    vector_queries: int
    # compaction and sweep: the sizes of the scaling curve
    compaction_sizes: tuple[int, ...]
    sweep_sizes: tuple[int, ...]
    compaction_keep: int
    # rest: many short rounds, interleaved, so a slow second of the host's hits one round
    # of one endpoint, which the median leaves out, instead of a tenth of its only sample
    rest_rounds: int
    rest_seconds: float

    @classmethod
    def full(cls) -> Scale:
        return cls(
            smoke=False,
            rounds=5,
            store_items=10_000,
            store_ops=600,
            thread_events=100_000,
            memory_ops=1_000,
            vectors=100_000,
            vector_users=100,
            vector_dims=384,
            vector_queries=200,
            compaction_sizes=(10_000, 100_000, 1_000_000),
            sweep_sizes=(10_000, 100_000, 1_000_000),
            compaction_keep=500,
            rest_rounds=12,
            rest_seconds=2.5,
        )

    @classmethod
    def smoke_run(cls) -> Scale:
        return cls(
            smoke=True,
            rounds=1,
            store_items=200,
            store_ops=16,
            thread_events=1_000,
            memory_ops=16,
            vectors=1_000,
            vector_users=10,
            vector_dims=384,
            vector_queries=8,
            compaction_sizes=(1_000, 2_000),
            sweep_sizes=(1_000, 2_000),
            compaction_keep=50,
            rest_rounds=1,
            rest_seconds=0.2,
        )


MODES = {"seq": 1, "c8": 8}
