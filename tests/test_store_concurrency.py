"""DjangoStore across processes: one winner per if_absent race, one run per IdempotentOp key."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections import Counter
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from typing import Any

import pytest
from agentflow.errors import StoreConflict
from agentflow.prebuilt import IdempotentOp, IncompleteEffectError
from agentflow.store.base import Item
from asgiref.sync import sync_to_async

from afkmemory.conf import afk_settings
from afkmemory.models import StoreItem
from afkmemory.stores import DjangoStore, SyncDjangoStore, asyncpool
from tests.utils import in_processes, run

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"], transaction=True), pytest.mark.slow]

ALIASES = ["default", "postgres"]
WORKERS = 8
ROUNDS = 10
CLAIMS = ("claims",)
EFFECTS = ("effects", "send_email")
EFFECT_LOG = ("effects", "log")


@pytest.fixture
def barrier() -> Any:
    """A barrier the child processes wait on together, so their writes really overlap."""
    with multiprocessing.get_context("spawn").Manager() as manager:
        yield manager.Barrier(WORKERS)


def _ready(alias: str) -> DjangoStore:
    from django.db import connections

    connections[alias].ensure_connection()  # connect first: the race is the write, not the login
    return DjangoStore(using=alias)


def claim(alias: str, worker: int, barrier: Any, keys: list[str]) -> list[str]:
    """Race the other workers for each key in turn with ``put(if_absent=True)``; say who won."""
    store = _ready(alias)
    outcomes = []
    for key in keys:
        barrier.wait(timeout=60)  # start each race together
        try:
            run(store.put(CLAIMS, key, {"worker": worker}, if_absent=True))
            outcomes.append("won")
        except StoreConflict:
            outcomes.append("lost")
    return outcomes


@pytest.mark.parametrize("alias", ALIASES)
def test_if_absent_race_has_exactly_one_winner(alias, barrier):
    store = SyncDjangoStore(using=alias)
    # Many short races, not one: a check-then-insert loses only some of them.
    keys = [f"{kind}-{i}" for i in range(ROUNDS) for kind in ("fresh", "expired")]
    for key in keys:
        if key.startswith("expired"):
            store.put(CLAIMS, key, {"worker": "nobody"}, ttl=0)  # an expired claim is free to reclaim
    results = in_processes(claim, [(alias, w, barrier, keys) for w in range(WORKERS)])
    for i, key in enumerate(keys):
        outcomes = Counter(result[i] for result in results)
        assert outcomes == {"won": 1, "lost": WORKERS - 1}, key
        winner = next(w for w, result in enumerate(results) if result[i] == "won")
        assert store.get(CLAIMS, key).value == {"worker": winner}
    assert StoreItem.objects.using(alias).count() == len(keys)


def send_email(alias: str, worker: int, barrier: Any) -> list[str]:
    """Run effects through agentflow's IdempotentOp, racing the other workers for each message."""
    store = _ready(alias)
    op = IdempotentOp(store, EFFECTS)
    results = []
    for message in range(ROUNDS):

        async def effect(message: int = message) -> str:
            # The side effect leaves a trace of its own, one per run, so the test can count runs.
            await store.put(EFFECT_LOG, f"{message}-{worker}", "sent")
            return f"receipt-{worker}"

        barrier.wait(timeout=60)
        try:
            results.append(run(op.run(f"message-{message}", effect)))
        except IncompleteEffectError:
            results.append("in flight elsewhere")
    return results


@pytest.mark.parametrize("alias", ALIASES)
def test_idempotent_op_runs_its_effect_once_across_processes(alias, barrier):
    results = in_processes(send_email, [(alias, w, barrier) for w in range(WORKERS)])
    store = SyncDjangoStore(using=alias)
    for message in range(ROUNDS):
        runs = store.search(EFFECT_LOG, limit=1000)
        [winner] = [item.key.split("-")[1] for item in runs if item.key.startswith(f"{message}-")]
        receipt = f"receipt-{winner}"
        assert results[int(winner)][message] == receipt
        assert {r[message] for r in results} <= {receipt, "in flight elsewhere"}
        assert store.get(EFFECTS, f"message-{message}").value == {"status": "done", "result": receipt}
    # A later attempt, in this process, returns the stored result without running again.
    again = run(IdempotentOp(DjangoStore(using=alias), EFFECTS).run("message-0", _never))
    assert again == store.get(EFFECTS, "message-0").value["result"]


async def _never() -> str:
    raise AssertionError("the effect ran twice")


def _put_behind(store: DjangoStore, hold: Any, *, if_absent: bool = False) -> tuple[Item, datetime, Item | None]:
    """A put with a TTL shorter than its wait behind ``hold`` (which occupies what the put needs)."""

    async def scenario() -> tuple[Item, datetime, Item | None]:
        await store.put(("warm",), "up", 1)  # connected and compiled first
        ready = asyncio.Event()
        busy = asyncio.ensure_future(hold(ready))
        await ready.wait()
        item = await store.put(("cache",), f"doc-{if_absent}", {"v": 1}, ttl=0.4, if_absent=if_absent)
        returned_at = datetime.now(UTC)
        got = await store.get(("cache",), f"doc-{if_absent}")
        await busy
        return item, returned_at, got

    return run(scenario())


def test_a_pooled_read_that_waited_for_a_connection_past_an_items_expiry_does_not_return_it():
    """The reads took the time at the call: an item live then, expired by the time a pool
    connection was free, was returned. They read it as their statement goes out, as the
    store's thread does."""
    store = DjangoStore(using="postgres", async_pool=True)
    reads = (
        lambda: store.get(("cache",), "doc"),
        lambda: store.search(("cache",)),
        lambda: store.list_namespaces(prefix=("cache",)),
    )

    async def scenario() -> list[Any]:
        await asyncio.gather(*(read() for read in reads))  # connected and compiled first
        async with AsyncExitStack() as stack:
            for _ in range(afk_settings.ASYNC_POOL_SIZE):
                await stack.enter_async_context(asyncpool.connection("postgres"))
            await sync_to_async(SyncDjangoStore(using="postgres").put)(("cache",), "doc", {"v": 1}, ttl=0.5)
            waiting = asyncio.gather(*(read() for read in reads))
            await asyncio.sleep(0)  # the reads are called while the item is live, and wait for a connection
            await asyncio.sleep(0.7)
        return await waiting

    assert run(scenario()) == [None, [], []]


@pytest.mark.parametrize("alias", ALIASES)
def test_a_puts_ttl_counts_from_its_write_not_from_its_call(alias):
    """The store's thread runs one call at a time (a sweep, a slow query): a put waiting
    behind one longer than its TTL was written already expired, its clock read at the call.
    agentflow's stores count the TTL from the write (PostgresStore: NOW())."""

    async def hold(ready: asyncio.Event) -> None:
        busy = asyncio.ensure_future(sync_to_async(time.sleep)(0.6))  # the store's thread, busy
        await asyncio.sleep(0.05)
        ready.set()
        await busy

    item, returned_at, got = _put_behind(DjangoStore(using=alias), hold)
    assert datetime.fromisoformat(item.expires_at) > returned_at and got == item


def test_a_pooled_puts_ttl_counts_from_its_write_not_from_its_wait_for_a_connection():
    async def hold(ready: asyncio.Event) -> None:
        async with AsyncExitStack() as stack:
            for _ in range(afk_settings.ASYNC_POOL_SIZE):
                await stack.enter_async_context(asyncpool.connection("postgres"))
            ready.set()
            await asyncio.sleep(0.6)

    store = DjangoStore(using="postgres", async_pool=True)
    for if_absent in (False, True):  # a claim goes its own way
        item, returned_at, got = _put_behind(store, hold, if_absent=if_absent)
        assert datetime.fromisoformat(item.expires_at) > returned_at and got == item, if_absent
