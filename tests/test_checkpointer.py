"""One conformance suite for agentflow's Checkpointer: its MemoryCheckpointer is the oracle for DjangoCheckpointer."""

from __future__ import annotations

import re

import pytest
from agentflow.checkpoint import Checkpoint, Checkpointer, MemoryCheckpointer, ThreadInfo
from agentflow.errors import CheckpointConflict, CheckpointError
from django.db import connections
from django.test.utils import CaptureQueriesContext

from afkmemory.memory import MemoryEvent
from afkmemory.models import GraphCheckpoint, Thread
from afkmemory.stores import DjangoCheckpointer, DjangoMemoryStore
from tests.conftest import DJANGO_ALIASES as ALIASES
from tests.utils import run

pytestmark = pytest.mark.django_db(databases=list(ALIASES.values()))

BACKENDS = ["agentflow-memory", *ALIASES]


@pytest.fixture(params=BACKENDS)
def saver(request: pytest.FixtureRequest) -> Checkpointer:
    """A fresh, empty Checkpointer of each backend."""
    if request.param == "agentflow-memory":
        return MemoryCheckpointer()
    return DjangoCheckpointer(using=ALIASES[request.param])


@pytest.fixture(params=list(ALIASES))
def django_saver(request: pytest.FixtureRequest) -> DjangoCheckpointer:
    """DjangoCheckpointer only: for checks agentflow's MemoryCheckpointer does not make."""
    return DjangoCheckpointer(using=ALIASES[request.param])


def cp(thread: str = "t1", step: int = 1, **fields) -> Checkpoint:
    fields.setdefault("state", {"n": step})
    if "ts" not in fields:
        fields["ts"] = f"2026-01-01T00:00:{step:02d}+00:00"
    return Checkpoint(thread=thread, step=step, **fields)


def history(saver, thread: str) -> list[Checkpoint]:
    async def collect() -> list[Checkpoint]:
        return [c async for c in saver.history(thread)]

    return run(collect())


def steps(saver, thread: str) -> list[int]:
    return [c.step for c in history(saver, thread)]


def test_implements_agentflows_protocol(saver):
    assert isinstance(saver, Checkpointer)
    assert run(saver.put(cp())) == "t1:1"


def test_every_field_round_trips_with_revision_1(saver):
    original = cp(
        step=3,
        state={"messages": ["hi", {"role": "user", "text": "ü \U0001f600"}], "count": 2, "ok": True, "none": None},
        next=("review", "publish"),
        parent="t1:2",
        interrupted=True,
        interrupt_node="review",
        interrupt_payload={"type": "clarification", "question": "Which region?", "options": ["eu", "us"]},
        wake_at="2026-01-02T00:00:00+00:00",
        extra={"run": "r1"},
    )
    run(saver.put(original))
    stored = run(saver.get("t1", 3))
    assert stored == Checkpoint(**{**{f: getattr(original, f) for f in original.__slots__}, "revision": 1})
    assert stored.suspend_kind == "timer" and not stored.done


def test_rewriting_a_step_bumps_its_revision(saver):
    run(saver.put(cp(state={"v": 1})))
    run(saver.put(cp(state={"v": 2})))
    run(saver.put(cp(state={"v": 3})))
    stored = run(saver.get("t1", 1))
    assert (stored.state, stored.revision) == ({"v": 3}, 3)
    run(saver.put(cp(step=2)))
    assert run(saver.get("t1", 2)).revision == 1


def test_get_returns_the_latest_or_the_step_asked_for(saver):
    for step in [2, 10, 1, 3]:
        run(saver.put(cp(step=step)))
    assert run(saver.get("t1")).step == 10
    assert run(saver.get("t1", 3)).state == {"n": 3}
    assert run(saver.get("t1", 4)) is None
    assert run(saver.get("other")) is None
    assert run(saver.get("other", 1)) is None


def test_history_is_ascending_by_step_and_per_thread(saver):
    for step in [3, 1, 12, 2]:
        run(saver.put(cp(step=step)))
    run(saver.put(cp("t2", 5)))
    assert steps(saver, "t1") == [1, 2, 3, 12]
    assert [c.revision for c in history(saver, "t1")] == [1, 1, 1, 1]
    assert steps(saver, "t2") == [5]
    assert history(saver, "nope") == []


# -- if_revision ----------------------------------------------------------------------------------


def test_if_revision_0_creates_only_a_new_step(saver):
    run(saver.put(cp(state={"v": 1}), if_revision=0))
    with pytest.raises(CheckpointConflict) as caught:
        run(saver.put(cp(state={"v": 2}), if_revision=0))
    assert (caught.value.thread, caught.value.step, caught.value.expected, caught.value.actual) == ("t1", 1, 0, 1)
    assert run(saver.get("t1", 1)).state == {"v": 1}


def test_if_revision_guards_a_read_modify_write(saver):
    run(saver.put(cp(state={"v": 1})))
    read = run(saver.get("t1", 1))
    run(saver.put(cp(state={"v": 2}), if_revision=read.revision))  # the first resume wins
    with pytest.raises(CheckpointConflict) as caught:
        run(saver.put(cp(state={"v": 3}), if_revision=read.revision))  # the second read a stale revision
    assert (caught.value.expected, caught.value.actual) == (1, 2)
    stored = run(saver.get("t1", 1))
    assert (stored.state, stored.revision) == ({"v": 2}, 2)


def test_a_negative_if_revision_conflicts_as_in_agentflow(saver):
    with pytest.raises(CheckpointConflict) as caught:
        run(saver.put(cp(), if_revision=-1))
    assert (caught.value.expected, caught.value.actual) == (-1, 0)
    assert run(saver.get("t1")) is None


def test_if_revision_above_0_on_a_missing_step_conflicts(saver):
    with pytest.raises(CheckpointConflict) as caught:
        run(saver.put(cp(), if_revision=1))
    assert (caught.value.expected, caught.value.actual) == (1, 0)
    assert run(saver.get("t1")) is None


# -- listing and retention ------------------------------------------------------------------------


def test_list_threads_summarizes_each_threads_latest_checkpoint(saver):
    run(saver.put(cp("b", 1, next=("x",))))
    run(saver.put(cp("b", 2, next=())))  # finished
    run(saver.put(cp("a", 4, next=("review",), interrupted=True, interrupt_node="review")))
    run(saver.put(cp("c", 1, next=("y",))))  # running
    run(saver.put(cp("a", 1, next=("start",))))  # an older step written later changes nothing
    assert run(saver.list_threads()) == [
        ThreadInfo("a", 4, interrupted=True, done=False, ts=cp(step=4).ts),
        ThreadInfo("b", 2, interrupted=False, done=True, ts=cp(step=2).ts),
        ThreadInfo("c", 1, interrupted=False, done=False, ts=cp(step=1).ts),
    ]
    assert [t.thread for t in run(saver.list_threads(limit=1, offset=1))] == ["b"]
    assert run(saver.list_threads(limit=0)) == []
    assert run(saver.list_threads(offset=3)) == []


def test_delete_thread_removes_only_that_thread(saver):
    for step in (1, 2):
        run(saver.put(cp("t1", step)))
        run(saver.put(cp("t2", step)))
    run(saver.delete_thread("t1"))
    run(saver.delete_thread("never-existed"))
    assert run(saver.get("t1")) is None and history(saver, "t1") == []
    assert steps(saver, "t2") == [1, 2]
    assert [t.thread for t in run(saver.list_threads())] == ["t2"]


def test_prune_before_step(saver):
    for step in range(1, 6):
        run(saver.put(cp(step=step)))
    run(saver.put(cp("t2", 1)))
    assert run(saver.prune("t1", before_step=4)) == 3
    assert steps(saver, "t1") == [4, 5]
    assert steps(saver, "t2") == [1]
    assert run(saver.prune("t1", before_step=4)) == 0


def test_prune_older_than_compares_iso_timestamps(saver):
    for step in range(1, 6):
        run(saver.put(cp(step=step)))
    assert run(saver.prune("t1", older_than="2026-01-01T00:00:03+00:00")) == 2
    assert steps(saver, "t1") == [3, 4, 5]


@pytest.fixture(params=["agentflow-sqlite", *ALIASES])
def durable_saver(request: pytest.FixtureRequest, tmp_path) -> Checkpointer:
    """agentflow's SqliteCheckpointer, the oracle where its durable checkpointers and its MemoryCheckpointer differ."""
    if request.param == "agentflow-sqlite":
        from agentflow.checkpoint.sqlite import SqliteCheckpointer

        return SqliteCheckpointer(tmp_path / "checkpoints.db")
    return DjangoCheckpointer(using=ALIASES[request.param])


def test_prune_with_both_bounds_drops_what_both_match(durable_saver):
    saver = durable_saver
    for step in range(1, 7):
        run(saver.put(cp(step=step, ts=f"2026-01-01T00:00:{10 - step:02d}+00:00")))  # later steps, older ts
    assert run(saver.prune("t1", before_step=5, older_than="2026-01-01T00:00:08+00:00")) == 2  # steps 3 and 4
    assert steps(saver, "t1") == [1, 2, 5, 6]


def test_retention_by_age_that_spares_the_last_steps_keeps_an_idle_runs_latest(durable_saver):
    """The usual call: old checkpoints go, but never the newest steps, however old they are."""
    saver = durable_saver
    for step in range(1, 6):
        run(saver.put(cp(step=step, ts=f"2025-06-01T00:00:{step:02d}+00:00", interrupted=step == 5)))
    assert run(saver.prune("t1", before_step=4, older_than="2026-01-01T00:00:00+00:00")) == 3
    assert steps(saver, "t1") == [4, 5] and run(saver.get("t1")).interrupted


def test_prune_never_counts_a_checkpoint_without_ts_as_old(saver):
    run(saver.put(cp(step=1, ts="")))
    run(saver.put(cp(step=2)))
    assert run(saver.prune("t1", older_than="9999")) == 1
    assert steps(saver, "t1") == [1]


# -- stricter than the oracle ---------------------------------------------------------------------


def test_unserializable_state_is_a_checkpoint_error_and_writes_nothing(django_saver):
    for state in ({"x": {1, 2}}, {"x": object()}, {"x": float("nan")}, {1: "x"}, {"x": "a\x00"}):
        with pytest.raises(CheckpointError, match="not JSON-serializable"):
            run(django_saver.put(cp(state=state)))
    assert not GraphCheckpoint.objects.using(django_saver.sync.using).exists()
    assert not Thread.objects.using(django_saver.sync.using).exists()


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda s: s.put("not a checkpoint"), TypeError),
        (lambda s: s.put(cp(thread="")), ValueError),
        (lambda s: s.put(cp(thread="t" * 256)), ValueError),
        (lambda s: s.put(cp(step="1", ts="")), TypeError),
        (lambda s: s.put(cp(step=True)), TypeError),
        (lambda s: s.put(cp(step=2**63)), ValueError),
        (lambda s: s.put(cp(ts="x" * 65)), ValueError),
        (lambda s: s.put(cp(), if_revision=2**63), ValueError),
        (lambda s: s.get("t1", "1"), TypeError),
        (lambda s: s.get(None), TypeError),
        (lambda s: s.list_threads(limit=-1), ValueError),
        (lambda s: s.list_threads(offset=1.5), TypeError),
        (lambda s: s.prune("t1"), ValueError),
        (lambda s: s.prune("t1", before_step="3"), TypeError),
        (lambda s: s.prune("t1", older_than=3), TypeError),
        (lambda s: s.delete_thread(""), ValueError),
    ],
)
def test_bad_input_is_refused_and_writes_nothing(django_saver, call, error):
    run(django_saver.put(cp()))
    with pytest.raises(error):
        run(call(django_saver))
    assert steps(django_saver, "t1") == [1]


def test_owners_see_only_their_own_threads(django_saver, django_user_model):
    alias = django_saver.sync.using
    alice = django_user_model.objects.db_manager(alias).create_user("alice")
    savers = {"alice": DjangoCheckpointer(owner=alice, using=alias), "nobody": django_saver}
    for name, saver in savers.items():
        run(saver.put(cp(state={"who": name})))
    for name, saver in savers.items():
        assert run(saver.get("t1")).state == {"who": name}
        assert [t.thread for t in run(saver.list_threads())] == ["t1"]
    by_pk = DjangoCheckpointer(owner=alice.pk, using=alias)  # an owner may be given by primary key
    run(by_pk.put(cp(step=2, state={"who": "alice"})))
    assert steps(savers["alice"], "t1") == [1, 2]
    run(savers["alice"].delete_thread("t1"))
    assert run(django_saver.get("t1")).state == {"who": "nobody"}


def test_checkpoints_share_the_thread_of_afks_events(django_saver):
    """One Thread row holds AFK's events and agentflow's checkpoints; deleting one leaves the other."""
    alias = django_saver.sync.using
    memory = DjangoMemoryStore(using=alias)
    run(memory.append_event(MemoryEvent("e1", "t1", None, "message", 1, {"text": "hi"}, [])))
    run(django_saver.put(cp()))
    assert Thread.objects.using(alias).count() == 1
    run(django_saver.delete_thread("t1"))
    assert [e.id for e in run(memory.get_recent_events("t1"))] == ["e1"]


def test_list_threads_selects_status_fields_not_whole_payloads(django_saver):
    run(django_saver.put(cp(state={"big": "x" * 10_000}, next=("n",))))
    with CaptureQueriesContext(connections[django_saver.sync.using]) as captured:
        assert run(django_saver.list_threads())[0].latest_step == 1
    sql = " ".join(q["sql"] for q in captured.captured_queries)
    assert "interrupted" in sql  # read out of the payload by the database
    # The bare column, followed by another column or FROM, would ship each thread's whole state.
    assert not re.search(r'\."payload"(\s+AS\s+"\w+")?(,\s*"|\s+FROM)', sql), sql
