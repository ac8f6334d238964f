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
CLAIMS = ("claims",)
EFFECTS = ("effects", "send_email")
EFFECT_LOG = ("effects", "log")


@pytest.fixture
def barrier() -> Any:
    """A barrier the child processes wait on together, so their writes really overlap."""
    with multiprocessing.get_context("spawn").Manager() as manager:
        yield manager.Barrier(WORKERS)


def _ready(alias: str, barrier: Any) -> DjangoStore:
    from django.db import connections

    connections[alias].ensure_connection()  # connect first: the race is the write, not the login
    store = DjangoStore(using=alias)
    barrier.wait(timeout=60)
    return store


def claim(alias: str, worker: int, barrier: Any, keys: list[str]) -> list[str]:
    """Race the other workers for each key with ``put(if_absent=True)``; say who won."""
    store = _ready(alias, barrier)
    outcomes = []
    for key in keys:
        try:
            run(store.put(CLAIMS, key, {"worker": worker}, if_absent=True))
            outcomes.append("won")
        except StoreConflict:
            outcomes.append("lost")
        barrier.wait(timeout=60)  # start the next race together
    return outcomes


@pytest.mark.parametrize("alias", ALIASES)
def test_if_absent_race_has_exactly_one_winner(alias, barrier):
    store = SyncDjangoStore(using=alias)
    store.put(CLAIMS, "expired", {"worker": "nobody"}, ttl=0)  # an expired claim is free to reclaim
    keys = ["fresh", "expired"]
    results = in_processes(claim, [(alias, w, barrier, keys) for w in range(WORKERS)])
    for i, key in enumerate(keys):
        outcomes = Counter(result[i] for result in results)
        assert outcomes == {"won": 1, "lost": WORKERS - 1}, key
        winner = next(w for w, result in enumerate(results) if result[i] == "won")
        assert store.get(CLAIMS, key).value == {"worker": winner}
    assert StoreItem.objects.using(alias).count() == len(keys)


def send_email(alias: str, worker: int, barrier: Any) -> str:
    """Run one effect through agentflow's IdempotentOp, racing the other workers."""
    store = _ready(alias, barrier)
    op = IdempotentOp(store, EFFECTS)

    async def effect() -> str:
        # The side effect leaves a trace of its own, one per run, so the test can count runs.
        await store.put(EFFECT_LOG, f"worker-{worker}", "sent")
        return f"receipt-{worker}"

    try:
        return run(op.run("message-1", effect))
    except IncompleteEffectError:
        return "in flight elsewhere"


@pytest.mark.parametrize("alias", ALIASES)
def test_idempotent_op_runs_its_effect_once_across_processes(alias, barrier):
    results = in_processes(send_email, [(alias, w, barrier) for w in range(WORKERS)])
    runs = SyncDjangoStore(using=alias).search(EFFECT_LOG)
    assert len(runs) == 1
    winner = runs[0].key.removeprefix("worker-")
    assert results[int(winner)] == f"receipt-{winner}"
    assert set(results) <= {f"receipt-{winner}", "in flight elsewhere"}
    marker = SyncDjangoStore(using=alias).get(EFFECTS, "message-1")
    assert marker.value == {"status": "done", "result": f"receipt-{winner}"}
    # A later attempt, in this process, returns the stored result without running again.
    assert run(IdempotentOp(DjangoStore(using=alias), EFFECTS).run("message-1", _never)) == f"receipt-{winner}"


async def _never() -> str:
    raise AssertionError("the effect ran twice")
