"""DjangoCheckpointer across processes: conditional writes have one winner, plain writes lose nothing."""

from __future__ import annotations

import multiprocessing
from collections import Counter
from typing import Any

import pytest
from agentflow.checkpoint import Checkpoint
from agentflow.errors import CheckpointConflict

from afkmemory.models import Thread
from afkmemory.stores import DjangoCheckpointer, SyncDjangoCheckpointer
from tests.utils import in_processes, run

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"], transaction=True), pytest.mark.slow]

ALIASES = ["default", "postgres"]
WORKERS = 8
ROUNDS = 10  # many short races, not one: a read-then-write loses only some of them


@pytest.fixture
def barrier() -> Any:
    """A barrier the child processes wait on together, so their writes really overlap."""
    with multiprocessing.get_context("spawn").Manager() as manager:
        yield manager.Barrier(WORKERS)


def write(alias: str, worker: int, barrier: Any) -> list[str]:
    """For each step race the others to create it, then to update it from revision 1; then write plainly."""
    from django.db import connections

    connections[alias].ensure_connection()
    saver = DjangoCheckpointer(using=alias)
    races = [("race", step, revision) for step in range(1, ROUNDS + 1) for revision in (0, 1)]
    outcomes = []
    for thread, step, if_revision in [*races, ("new", 1, None)]:
        barrier.wait(timeout=60)
        try:
            run(saver.put(Checkpoint(thread, step, {"worker": worker}), if_revision=if_revision))
            outcomes.append("won")
        except CheckpointConflict:
            outcomes.append("lost")
    return outcomes


@pytest.mark.parametrize("alias", ALIASES)
def test_racing_resumes_get_one_winner_and_plain_writes_count_every_write(alias, barrier):
    saver = SyncDjangoCheckpointer(using=alias)
    # The thread exists already, so the racers meet on the checkpoint rows themselves
    # (creating the thread would queue them up behind the first one's transaction).
    saver.put(Checkpoint("race", 0, {}))
    results = in_processes(write, [(alias, w, barrier) for w in range(WORKERS)])
    for step in range(1, ROUNDS + 1):
        created, updated = (Counter(r[2 * (step - 1) + i] for r in results) for i in (0, 1))
        # Both conditional writes start from one known revision: exactly one racer may succeed.
        assert created == {"won": 1, "lost": WORKERS - 1}, step
        assert updated == {"won": 1, "lost": WORKERS - 1}, step
        winner = next(w for w, r in enumerate(results) if r[2 * (step - 1) + 1] == "won")
        stored = saver.get("race", step)
        assert (stored.revision, stored.state) == (2, {"worker": winner})
    assert Counter(r[-1] for r in results) == {"won": WORKERS}
    assert saver.get("new", 1).revision == WORKERS  # every unconditional write bumped it once
    assert Thread.objects.using(alias).count() == 2  # "new" was created once, though all raced to
