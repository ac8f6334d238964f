"""DjangoStore across processes: one winner per if_absent race, one run per IdempotentOp key."""

from __future__ import annotations

import multiprocessing
from collections import Counter
from typing import Any

import pytest
from agentflow.errors import StoreConflict
from agentflow.prebuilt import IdempotentOp, IncompleteEffectError

from afkmemory.models import StoreItem
from afkmemory.stores import DjangoStore, SyncDjangoStore
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
