"""One conformance suite for every MemoryStore backend; InMemoryMemoryStore is the oracle."""

from __future__ import annotations

import random

import numpy as np
import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from afkmemory import models
from afkmemory.memory import (
    DuplicateEventError,
    EffectMismatchError,
    LongTermMemory,
    MemoryEvent,
    RetentionPolicy,
    StateRetentionPolicy,
    compact_thread,
    hash_tool_input,
)
from afkmemory.memory.text import MAX_QUERY_TERMS
from afkmemory.memory.types import MAX_JSON_DEPTH
from afkmemory.stores import DjangoMemoryStore, SyncDjangoMemoryStore
from tests.api_helpers import make_user
from tests.conftest import DIMENSIONS, DJANGO_ALIASES
from tests.utils import run

pytestmark = pytest.mark.django_db(databases=list(DJANGO_ALIASES.values()))


def ev(i: int, thread: str = "t1", *, ts: int | None = None, kind: str = "message", **payload) -> MemoryEvent:
    return MemoryEvent(f"e{i}", thread, "u1", kind, i if ts is None else ts, payload or {"n": i}, ["x"])


def mem(ident: str, *, user: str | None = "u1", scope: str = "global", text: str = "", updated: int = 1000, **kw):
    return LongTermMemory(ident, user, scope, kw.pop("data", {}), text, kw.pop("tags", []), {}, 1000, updated)


def ids(items) -> list[str]:
    return [item.id for item in items]


# -- events -------------------------------------------------------------------------------------


def test_recent_events_are_the_newest_returned_oldest_first(memory_store):
    for i in [3, 1, 4, 0, 2, 5]:
        run(memory_store.append_event(ev(i)))
    assert ids(run(memory_store.get_recent_events("t1", limit=3))) == ["e3", "e4", "e5"]
    assert ids(run(memory_store.get_recent_events("t1"))) == ["e0", "e1", "e2", "e3", "e4", "e5"]
    assert run(memory_store.get_recent_events("t1", limit=0)) == []
    assert run(memory_store.get_recent_events("nope")) == []


def test_equal_timestamps_keep_insertion_order(memory_store):
    for i in range(5):
        run(memory_store.append_event(ev(i, ts=7)))
    assert ids(run(memory_store.get_recent_events("t1", limit=2))) == ["e3", "e4"]
    assert ids(run(memory_store.get_events_since("t1", 7))) == ["e0", "e1", "e2", "e3", "e4"]


def test_events_round_trip_every_field(memory_store):
    event = MemoryEvent("e1", "t1", None, "tool_call", 5, {"args": {"q": "ü", "n": [1, 2.5, None, True]}}, ["a", "b"])
    run(memory_store.append_event(event))
    assert run(memory_store.get_recent_events("t1")) == [event]


def test_events_since_is_inclusive_ordered_and_limited(memory_store):
    for i in range(10):
        run(memory_store.append_event(ev(i, ts=i * 10)))
    assert ids(run(memory_store.get_events_since("t1", 30, limit=3))) == ["e3", "e4", "e5"]
    assert ids(run(memory_store.get_events_since("t1", 95))) == []


def test_threads_are_separate(memory_store):
    run(memory_store.append_event(ev(1, "a")))
    run(memory_store.append_event(ev(1, "b")))  # the same event id in another thread is fine
    assert ids(run(memory_store.get_recent_events("a"))) == ["e1"]
    assert [e.thread_id for e in run(memory_store.get_recent_events("b"))] == ["b"]


def test_duplicate_event_id_is_refused_and_nothing_changes(memory_store):
    run(memory_store.append_event(ev(1)))
    with pytest.raises(DuplicateEventError, match="already exists") as refused:
        run(memory_store.append_event(MemoryEvent("e1", "t1", None, "message", 99, {"other": 1}, [])))
    assert (refused.value.event_id, refused.value.thread_id) == ("e1", "t1")
    assert run(memory_store.get_recent_events("t1")) == [ev(1)]


@pytest.mark.parametrize(
    ("event", "error"),
    [
        (MemoryEvent("e1", "t1", None, "chat", 1, {}, []), ValueError),
        (MemoryEvent("", "t1", None, "message", 1, {}, []), ValueError),
        (MemoryEvent("e1", "", None, "message", 1, {}, []), ValueError),
        (MemoryEvent("e1", "t1", None, "message", -1, {}, []), ValueError),
        (MemoryEvent("e1", "t1", None, "message", True, {}, []), TypeError),
        (MemoryEvent("e1", "t1", None, "message", 1, {"x": {1, 2}}, []), TypeError),
        (MemoryEvent("e1", "t1", None, "message", 1, {"x": float("nan")}, []), ValueError),
        (MemoryEvent("e1", "t1", None, "message", 1, {1: "x"}, []), TypeError),
        (MemoryEvent("e1", "t1", None, "message", 1, {"x": "a\x00b"}, []), ValueError),
        # a lone surrogate: SQLite would keep it, PostgreSQL's json refuses it
        (MemoryEvent("e1", "t1", None, "message", 1, {"x": "a\ud800b"}, []), ValueError),
        (MemoryEvent("e1", "t1", None, "message", 1, {"a\udc00": 1}, []), ValueError),
        (MemoryEvent("e\ud800", "t1", None, "message", 1, {}, []), ValueError),
        (MemoryEvent("e1", "t1", None, "message", 1, {}, ["\ud800"]), ValueError),
        (MemoryEvent("e1", "t1", None, "message", 2**63, {}, []), ValueError),  # past a 64-bit column
        (MemoryEvent("e1", "t1", None, "message", 1, [], []), TypeError),
        (MemoryEvent("e1", "t1", None, "message", 1, {}, "tag"), TypeError),
        (MemoryEvent("e1", "t" * 256, None, "message", 1, {}, []), ValueError),
        ("not an event", TypeError),
    ],
)
def test_bad_events_raise_and_write_nothing(memory_store, event, error):
    with pytest.raises(error):
        run(memory_store.append_event(event))
    assert run(memory_store.get_recent_events("t1")) == []


@pytest.mark.parametrize("limit", [-1, 1.5, "3", True])
def test_bad_limits_are_refused(memory_store, limit):
    with pytest.raises((ValueError, TypeError)):
        run(memory_store.get_recent_events("t1", limit=limit))
    with pytest.raises((ValueError, TypeError)):
        run(memory_store.list_long_term_memories("u1", limit=limit))
    with pytest.raises((ValueError, TypeError)):
        run(memory_store.search_long_term_memory_text("u1", "x", limit=limit))


def test_the_largest_allowed_limit_returns_everything(memory_store):
    largest = 2**63 - 1  # check_limit's bound; a double (Redis's Lua) would round it to 2**63
    for i in range(3):
        run(memory_store.append_event(ev(i)))
    run(memory_store.upsert_long_term_memory(mem("m1")))
    assert ids(run(memory_store.get_recent_events("t1", limit=largest))) == ["e0", "e1", "e2"]
    assert ids(run(memory_store.get_events_since("t1", 1, limit=largest))) == ["e1", "e2"]
    assert ids(run(memory_store.list_long_term_memories("u1", limit=largest))) == ["m1"]


def test_replace_thread_events_replaces_atomically(memory_store):
    for i in range(4):
        run(memory_store.append_event(ev(i)))
    run(memory_store.replace_thread_events("t1", [ev(9, ts=2), ev(8, ts=1), ev(7, ts=2)]))
    assert ids(run(memory_store.get_recent_events("t1"))) == ["e8", "e9", "e7"]
    with pytest.raises(ValueError, match="belongs to thread"):
        run(memory_store.replace_thread_events("t1", [ev(1, "other")]))
    with pytest.raises(ValueError, match="duplicate"):
        run(memory_store.replace_thread_events("t1", [ev(1), ev(1)]))
    assert ids(run(memory_store.get_recent_events("t1"))) == ["e8", "e9", "e7"]


# -- compaction ---------------------------------------------------------------------------------


def test_compaction_keeps_protected_types_then_the_newest(memory_store):
    kinds = ["trace", "message", "message", "trace", "tool_call", "message", "trace", "message"]
    for i, kind in enumerate(kinds):
        run(memory_store.append_event(ev(i, kind=kind)))
    result = run(compact_thread(memory_store, thread_id="t1", event_policy=RetentionPolicy(max_events_per_thread=5)))
    # three traces are protected; the two newest others fill the budget of five
    assert ids(run(memory_store.get_recent_events("t1"))) == ["e0", "e3", "e5", "e6", "e7"]
    assert (result.events_before, result.events_after, result.events_removed) == (8, 5, 3)


def test_compaction_with_more_protected_than_budget_keeps_newest_protected(memory_store):
    for i in range(6):
        run(memory_store.append_event(ev(i, kind="trace" if i % 2 == 0 else "message")))
    policy = RetentionPolicy(max_events_per_thread=2, keep_event_types=["trace"])
    run(compact_thread(memory_store, thread_id="t1", event_policy=policy))
    assert ids(run(memory_store.get_recent_events("t1"))) == ["e2", "e4"]


def test_compaction_drops_everything_older_than_the_scan_window(memory_store):
    for i in range(10):
        run(memory_store.append_event(ev(i, kind="trace" if i < 3 else "message")))
    policy = RetentionPolicy(max_events_per_thread=3, scan_limit=5)
    result = run(compact_thread(memory_store, thread_id="t1", event_policy=policy))
    assert ids(run(memory_store.get_recent_events("t1"))) == ["e7", "e8", "e9"]
    assert (result.events_before, result.events_after, result.events_removed) == (10, 3, 7)


def test_compaction_of_nothing_and_with_zero_budget(memory_store):
    result = run(compact_thread(memory_store, thread_id="empty"))
    assert (result.events_before, result.events_removed) == (0, 0)
    for i in range(3):
        run(memory_store.append_event(ev(i, kind="trace")))
    run(compact_thread(memory_store, thread_id="t1", event_policy=RetentionPolicy(max_events_per_thread=0)))
    assert run(memory_store.get_recent_events("t1")) == []
    run(memory_store.append_event(ev(5)))  # the thread goes on after compaction
    assert ids(run(memory_store.get_recent_events("t1"))) == ["e5"]


def test_retention_policy_validates():
    with pytest.raises(ValueError):
        RetentionPolicy(max_events_per_thread=-1)
    with pytest.raises(ValueError):
        RetentionPolicy(scan_limit=0)
    with pytest.raises(ValueError, match="unknown event types"):
        RetentionPolicy(keep_event_types=["traces"])


# -- state --------------------------------------------------------------------------------------


def test_state_put_get_overwrite_delete(memory_store):
    assert run(memory_store.get_state("t1", "k")) is None
    run(memory_store.put_state("t1", "k", {"a": [1, 2]}))
    assert run(memory_store.get_state("t1", "k")) == {"a": [1, 2]}
    run(memory_store.put_state("t1", "k", "v2"))
    assert run(memory_store.get_state("t1", "k")) == "v2"
    assert run(memory_store.get_state("t2", "k")) is None
    run(memory_store.delete_state("t1", "k"))
    run(memory_store.delete_state("t1", "k"))  # deleting an absent key is fine
    assert run(memory_store.get_state("t1", "k")) is None


def test_list_state_is_sorted_and_prefix_is_literal(memory_store):
    keys = ["b", "a:1", "a:2", "A:3", "a%x", "a_y", "ab", "é", "a", "z:ü"]
    for i, key in enumerate(keys):
        run(memory_store.put_state("t1", key, i))
    assert list(run(memory_store.list_state("t1"))) == sorted(keys)
    assert run(memory_store.list_state("t1", "a:")) == {"a:1": 1, "a:2": 2}
    assert list(run(memory_store.list_state("t1", "a%"))) == ["a%x"]
    assert list(run(memory_store.list_state("t1", "a_"))) == ["a_y"]
    assert list(run(memory_store.list_state("t1", "A"))) == ["A:3"]
    assert list(run(memory_store.list_state("t1", "a"))) == ["a", "a%x", "a:1", "a:2", "a_y", "ab"]
    assert run(memory_store.list_state("t1", "nothing")) == {}


@pytest.mark.parametrize(
    "key",
    [
        "checkpoint:r:1:" + "p" * 300,  # a phase past the checkpoint table's column
        "checkpoint:" + "r" * 300 + ":1:pre_llm",
        "effect:" + "r" * 300 + ":1:call",
        f"checkpoint:r:{2**63}:pre_llm",  # a step past a 64-bit column
        "checkpoint:r:99999999999999999999999:pre_llm",
    ],
)
def test_a_checkpoint_or_effect_key_whose_parts_do_not_fit_is_a_plain_key(memory_store, key):
    """Every backend stores it, reads it back, lists it and deletes it, as any other key."""
    run(memory_store.put_state("t1", key, {"payload": 1}))
    assert run(memory_store.get_state("t1", key)) == {"payload": 1}
    assert run(memory_store.list_state("t1")) == {key: {"payload": 1}}
    run(memory_store.delete_state("t1", key))
    assert run(memory_store.list_state("t1")) == {}


def test_an_effect_key_with_a_long_tool_call_id_is_an_effect(memory_store):
    """The effect table's column holds any tool call id a key can: such keys stay effects (and stay where they were)."""
    key = "effect:r:1:" + "c" * 900
    run(memory_store.put_state("t1", key, {"output": 1}))
    assert run(memory_store.get_state("t1", key)) == {"output": 1}
    assert run(memory_store.list_state("t1", "effect:r:1:")) == {key: {"output": 1}}


def test_an_effect_whose_input_hash_is_long_is_kept_whole(memory_store):
    value = {"input_hash": "h" * 300, "output": 1}
    run(memory_store.put_state("t1", "effect:r:1:call-1", value))
    assert run(memory_store.get_state("t1", "effect:r:1:call-1")) == value


def test_put_state_many_writes_all(memory_store):
    run(memory_store.put_state_many("t1", {"x": 1, "y": [2], "checkpoint:r:1:pre_llm": {"payload": 3}}))
    assert run(memory_store.list_state("t1")) == {"checkpoint:r:1:pre_llm": {"payload": 3}, "x": 1, "y": [2]}


@pytest.mark.parametrize(
    ("thread", "key", "value", "error"),
    [
        ("", "k", 1, ValueError),
        ("t1", "", 1, ValueError),
        ("t1", 5, 1, TypeError),
        ("t1", "k", object(), TypeError),
        ("t1", "k", {"x": float("inf")}, ValueError),
        ("t1", "k" * 1025, 1, ValueError),
        ("t1", "k", {"x": "a\ud800"}, ValueError),
        ("t1", "k\udfff", 1, ValueError),
    ],
)
def test_bad_state_writes_raise_and_write_nothing(memory_store, thread, key, value, error):
    with pytest.raises(error):
        run(memory_store.put_state(thread, key, value))
    assert run(memory_store.list_state("t1")) == {}


# -- checkpoints and the effect journal ---------------------------------------------------------


def test_checkpoints_latest_and_key_layout(memory_store):
    assert run(memory_store.latest_checkpoint("t1", "run-1")) is None
    run(memory_store.write_checkpoint("t1", "run-1", 0, "pre_llm", {"messages": 1}))
    run(memory_store.write_checkpoint("t1", "run-1", 0, "post_tool_batch", {"messages": 2}))
    run(memory_store.write_checkpoint("t1", "run-1", 1, "step_end", {"messages": 3}))
    run(memory_store.write_checkpoint("t1", "run-10", 0, "pre_llm", {"other": True}))
    latest = run(memory_store.latest_checkpoint("t1", "run-1"))
    assert (latest.step, latest.phase, latest.payload) == (1, "step_end", {"messages": 3})
    listed = run(memory_store.list_checkpoints("t1", "run-1"))
    assert [c.step for c in listed] == [0, 0, 1]  # step order; within a step, write time
    assert {c.phase for c in listed[:2]} == {"pre_llm", "post_tool_batch"}
    state = run(memory_store.list_state("t1", "checkpoint:run-1:"))
    assert list(state) == [
        "checkpoint:run-1:0:post_tool_batch",
        "checkpoint:run-1:0:pre_llm",
        "checkpoint:run-1:1:step_end",
        "checkpoint:run-1:latest",
    ]
    assert state["checkpoint:run-1:0:pre_llm"]["payload"] == {"messages": 1}
    assert state["checkpoint:run-1:latest"]["key"] == "checkpoint:run-1:1:step_end"
    assert len(run(memory_store.list_state("t1", "checkpoint:run-1"))) == 6  # run-1 and run-10
    assert run(memory_store.get_state("t1", "checkpoint:run-10:0:pre_llm"))["payload"] == {"other": True}
    run(memory_store.delete_state("t1", "checkpoint:run-10:0:pre_llm"))
    assert run(memory_store.get_state("t1", "checkpoint:run-10:0:pre_llm")) is None
    with pytest.raises(ValueError, match="':'"):
        run(memory_store.write_checkpoint("t1", "a:b", 0, "pre_llm", {}))
    with pytest.raises(ValueError, match="64-bit"):
        run(memory_store.write_checkpoint("t1", "run-1", 2**63, "pre_llm", {}))


def test_effect_journal_replays_and_refuses_a_different_input(memory_store):
    good = hash_tool_input({"city": "Paris"})
    assert run(memory_store.get_effect("t1", "run-1", 2, "call-7", input_hash=good)) is None
    run(memory_store.record_effect("t1", "run-1", 2, "call-7", input_hash=good, output={"temp": 21}))
    replay = run(memory_store.get_effect("t1", "run-1", 2, "call-7", input_hash=good))
    assert (replay.output, replay.input_hash) == ({"temp": 21}, good)
    with pytest.raises(EffectMismatchError):
        run(memory_store.get_effect("t1", "run-1", 2, "call-7", input_hash=hash_tool_input({"city": "Rome"})))
    assert run(memory_store.get_state("t1", "effect:run-1:2:call-7"))["output"] == {"temp": 21}
    assert list(run(memory_store.list_state("t1", "effect:"))) == ["effect:run-1:2:call-7"]
    assert hash_tool_input({"a": 1, "b": 2}) == hash_tool_input({"b": 2, "a": 1})


@pytest.mark.parametrize("alias", ["default", "postgres"])
def test_the_sync_and_async_django_stores_have_the_same_methods(alias):
    """The README: the Sync twins "have the same methods without await". The sync memory
    store had no effect journal (a sync view or `manage.py shell` got an AttributeError),
    and the async one lacked the sync one's extras (append_events, the fused search...)."""

    def methods(store: type) -> set[str]:
        return {name for name in dir(store) if not name.startswith("_") and callable(getattr(store, name))}

    hooks = {"setup", "close"}  # the async lifecycle hooks: nothing to do synchronously
    assert methods(DjangoMemoryStore) - hooks == methods(SyncDjangoMemoryStore)
    store = SyncDjangoMemoryStore(using=alias)
    good = hash_tool_input({"city": "Paris"})
    assert store.get_effect("t1", "run-1", 2, "call-7", input_hash=good) is None
    recorded = store.record_effect("t1", "run-1", 2, "call-7", input_hash=good, output={"temp": 21})
    assert store.get_effect("t1", "run-1", 2, "call-7", input_hash=good) == recorded
    with pytest.raises(EffectMismatchError, match="ran with input"):
        store.get_effect("t1", "run-1", 2, "call-7", input_hash=hash_tool_input({"city": "Rome"}))
    with pytest.raises(ValueError, match="run_id"):
        store.record_effect("t1", "a:b", 2, "call-7", input_hash=good, output=None)
    assert list(store.list_state("t1")) == ["effect:run-1:2:call-7"]  # AFK's key, as the async store writes it
    # The async twins of the sync store's extras.
    twin = DjangoMemoryStore(using=alias)
    run(twin.append_events([ev(1, "t2"), ev(2, "t2")]))
    assert ids(run(twin.get_recent_events("t2"))) == ["e1", "e2"]
    run(twin.put_state("t2", "k", None))
    assert (run(twin.lookup_state("t2", "k")), run(twin.lookup_state("t2", "other"))) == ((True, None), (False, None))
    assert [run(twin.save_long_term_memory(mem("m1", text="paris trip"))) for _ in range(2)] == [True, False]
    [(found, _, similarity)] = run(twin.search_long_term_memory_fused("u1", query="paris"))
    assert (found.id, similarity) == ("m1", None)


def test_state_and_journal_keys_list_together_in_key_order(memory_store):
    run(memory_store.put_state("t1", "zeta", 1))
    run(memory_store.put_state("t1", "checkpoint:r:notanumber:x", 2))  # not a checkpoint key: plain state
    run(memory_store.write_checkpoint("t1", "r", 3, "pre_llm", {}))
    run(memory_store.record_effect("t1", "r", 3, "c:1", input_hash="h", output=None))
    assert list(run(memory_store.list_state("t1"))) == [
        "checkpoint:r:3:pre_llm",
        "checkpoint:r:latest",
        "checkpoint:r:notanumber:x",
        "effect:r:3:c:1",
        "zeta",
    ]
    assert list(run(memory_store.list_state("t1", "checkpoint:r:3"))) == ["checkpoint:r:3:pre_llm"]


def _awkward_state(store: SyncDjangoMemoryStore, alias: str, thread: str = "t1") -> None:
    """Plain, checkpoint and effect keys whose text order is not their columns' order."""
    store.put_state_many(
        thread,
        {
            "plan": {"step": 2},
            "nothing": None,
            "checkpoint": 1,
            "checkpoint;": 2,  # just past every checkpoint key
            "checkpoint:a:latest": {"key": "checkpoint:a:10:pre_llm"},
            "checkpoint:a:01:x": "a step that is not canonical: a plain key",
            "checkpoint:a:": "no step",
            "effect:a:1": "three parts: plain",
            "effect:" + "r" * 300 + ":1:c": "a run id too long for its column: plain",
            "a&b=c+d %/é\t?#": "odd characters",
            "é": "after every ASCII key",
        },
    )
    for run_id in ("a", "a-1", "a0", "aé", "b"):
        for step in (0, 1, 2, 9, 10, 11, 100, 2**63 - 1):
            store.write_checkpoint(thread, run_id, step, "pre_llm", {"run": run_id, "step": step})
            store.write_checkpoint(thread, run_id, step, "post:tool", [step])
            store.record_effect(thread, run_id, step, f"call:{step}", input_hash="h", output=step)
    # A checkpoint key in the plain table too (written around the store): the journal's row wins, as in list_state.
    thread_row = models.Thread.objects.using(alias).get(thread_id=thread, owner=None)
    models.StateEntry.objects.using(alias).create(thread=thread_row, key="checkpoint:a:10:pre_llm", value="stale")


#: The Django backends of ``memory_store`` only: ``state_page`` is the Django stores' (the REST API's).
DJANGO_BACKENDS = pytest.mark.parametrize("memory_store", list(DJANGO_ALIASES), indirect=True)


@DJANGO_BACKENDS
def test_state_pages_are_list_state_a_page_at_a_time(memory_store):
    """Every page is the slice of list_state after ``after``: same keys, values and order."""
    store = memory_store.sync
    _awkward_state(store, store.using)
    everything = store.list_state("t1")
    assert everything["checkpoint:a:10:pre_llm"] != "stale"
    for prefix in (None, "checkpoint:", "checkpoint:a", "checkpoint:a:", "checkpoint:a:1", "effect:a", "e", "é", "z"):
        full = list(store.list_state("t1", prefix).items())
        for after in (None, "a", "checkpoint:a-1:1", "checkpoint:a:100:pre_llm", "checkpoint:a:2", "effect:", "zz"):
            for limit in (1, 7, len(full) or 1, 1000):
                rest = [(k, v) for k, v in full if after is None or k > after]
                page, last = store.state_page("t1", prefix, after, limit)
                assert list(page.items()) == rest[:limit], (prefix, after, limit)
                assert last == (rest[limit - 1][0] if len(rest) > limit else None), (prefix, after, limit)
        walked: list[tuple[str, object]] = []
        after = None
        while True:
            page, after = store.state_page("t1", prefix, after, 4)
            assert page or not full
            walked.extend(page.items())
            if after is None:
                break
        assert walked == full, prefix


def test_a_state_value_nested_too_deep_is_refused_by_put_state_as_by_put_state_many(memory_store):
    """The in-memory store's put_state took a value nested past MAX_JSON_DEPTH that every other
    backend (and its own put_state_many) refuses (helper-92's review)."""
    deep: list = []
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    for write in (
        lambda: memory_store.put_state("t1", "k", deep),
        lambda: memory_store.put_state_many("t1", {"k": deep}),
    ):
        with pytest.raises(ValueError, match=f"nested deeper than {MAX_JSON_DEPTH}"):
            run(write())
    assert run(memory_store.get_state("t1", "k")) is None


@DJANGO_BACKENDS
def test_a_state_page_is_one_statement_and_refuses_bad_arguments(memory_store):
    store, alias = memory_store.sync, memory_store.sync.using
    store.put_state("t1", "k", 1)
    store.write_checkpoint("t1", "r", 1, "p", None)
    expected = dict(list(store.list_state("t1").items())[:2])
    with CaptureQueriesContext(connections[alias]) as captured:
        assert store.state_page("t1", limit=2) == (expected, "checkpoint:r:latest")
    assert len(captured.captured_queries) == 1, [q["sql"] for q in captured.captured_queries]
    assert store.state_page("missing") == ({}, None)
    assert SyncDjangoMemoryStore(owner=make_user(alias, "alice"), using=alias).state_page("t1") == ({}, None)
    assert run(memory_store.state_page("t1", "k")) == ({"k": 1}, None)  # the async twin
    for bad, error in (
        ({"limit": 0}, ValueError),
        ({"limit": -1}, ValueError),
        ({"limit": "2"}, TypeError),
        ({"after": ""}, ValueError),
        ({"after": "nul\x00"}, ValueError),
        ({"after": "k" * 1025}, ValueError),
        ({"prefix": 1}, TypeError),
    ):
        with pytest.raises(error):
            store.state_page("t1", **bad)


# -- long-term memory ---------------------------------------------------------------------------


def test_list_memories_newest_first_by_user_and_scope(memory_store):
    run(memory_store.upsert_long_term_memory(mem("m1", updated=1)))
    run(memory_store.upsert_long_term_memory(mem("m2", updated=3, scope="prefs")))
    run(memory_store.upsert_long_term_memory(mem("m3", updated=2)))
    run(memory_store.upsert_long_term_memory(mem("m4", user="u2", updated=9)))
    run(memory_store.upsert_long_term_memory(mem("m5", user=None, updated=9)))
    assert ids(run(memory_store.list_long_term_memories("u1"))) == ["m2", "m3", "m1"]
    assert ids(run(memory_store.list_long_term_memories("u1", scope="global"))) == ["m3", "m1"]
    assert ids(run(memory_store.list_long_term_memories("u1", limit=1))) == ["m2"]
    assert ids(run(memory_store.list_long_term_memories(None))) == ["m5"]


def test_upsert_replaces_but_keeps_created_at_and_embedding(memory_store):
    first = LongTermMemory("m1", "u1", "global", {"v": 1}, "old", ["a"], {"k": 1}, 100, 100)
    run(memory_store.upsert_long_term_memory(first, embedding=[1.0] + [0.0] * (DIMENSIONS - 1)))
    second = LongTermMemory("m1", "u1", "prefs", {"v": 2}, "new", ["b"], {"k": 2}, 500, 600)
    run(memory_store.upsert_long_term_memory(second))
    (stored,) = run(memory_store.list_long_term_memories("u1"))
    assert stored == LongTermMemory("m1", "u1", "prefs", {"v": 2}, "new", ["b"], {"k": 2}, 100, 600)
    hits = run(memory_store.search_long_term_memory_vector("u1", [1.0] + [0.0] * (DIMENSIONS - 1)))
    assert [(m.id, round(score, 5)) for m, score in hits] == [("m1", 1.0)]


def test_delete_memory_only_for_its_user(memory_store):
    run(memory_store.upsert_long_term_memory(mem("m1")))
    run(memory_store.delete_long_term_memory("someone-else", "m1"))
    assert ids(run(memory_store.list_long_term_memories("u1"))) == ["m1"]
    run(memory_store.delete_long_term_memory("u1", "m1"))
    assert run(memory_store.list_long_term_memories("u1")) == []


def test_bad_memories_raise_and_write_nothing(memory_store):
    bad = [
        (mem(""), ValueError),
        (mem("m1", scope=""), ValueError),
        (LongTermMemory("m1", "u1", "s", [], None, [], {}, 1, 1), TypeError),
        (LongTermMemory("m1", "u1", "s", {}, 5, [], {}, 1, 1), TypeError),
        (LongTermMemory("m1", "u1", "s", {}, None, [], {}, -1, 1), ValueError),
    ]
    for memory, error in bad:
        with pytest.raises(error):
            run(memory_store.upsert_long_term_memory(memory))
    for embedding, error in [([1.0] * (DIMENSIONS + 1), ValueError), ([0.0] * DIMENSIONS, ValueError),
                             ([1e39] * DIMENSIONS, ValueError), ([float("nan")] * DIMENSIONS, ValueError),
                             (["x"] * DIMENSIONS, TypeError), ("abc", TypeError),
                             # one bad number among floats (check_embedding's fast path)
                             ([1.0] * (DIMENSIONS - 1) + [float("inf")], ValueError),
                             ([1.0] * (DIMENSIONS - 1) + [float("nan")], ValueError),
                             ([1.0] * (DIMENSIONS - 1) + [4e38], ValueError),
                             ([1e308, 1e308] + [1.0] * (DIMENSIONS - 2), ValueError),
                             # zero once stored as float32, or a squared length past float32's range:
                             # either way pgvector's cosine similarity is NaN
                             ([1e-46] * DIMENSIONS, ValueError), ([1e-30] * DIMENSIONS, ValueError),
                             ([1e38] * DIMENSIONS, ValueError), ([3e19] + [0.0] * (DIMENSIONS - 1), ValueError),
                             ([1.0] * (DIMENSIONS - 1) + [True], TypeError)]:  # fmt: skip
        with pytest.raises(error):
            run(memory_store.upsert_long_term_memory(mem("m1"), embedding=embedding))
    assert run(memory_store.list_long_term_memories("u1")) == []


def test_numpy_numbers_are_embeddings_and_bad_ones_are_still_refused(memory_store):
    """``list(model.encode(text))`` holds numpy float32 numbers, which are no Python floats (as
    np.float64 is): they were a TypeError, while the array itself was accepted."""
    vector = np.arange(1, DIMENSIONS + 1, dtype=np.float32)
    run(memory_store.upsert_long_term_memory(mem("f32"), embedding=list(vector)))
    run(memory_store.upsert_long_term_memory(mem("i64"), embedding=list(-np.arange(1, DIMENSIONS + 1))))
    hits = run(memory_store.search_long_term_memory_vector("u1", list(vector.astype(np.float16))))
    assert [(m.id, s) for m, s in hits] == [("f32", 1.0), ("i64", -1.0)]
    one = np.float32(1.0)
    for embedding, error in [([one] * (DIMENSIONS - 1) + [np.float32("nan")], ValueError),
                             ([one] * (DIMENSIONS - 1) + [np.float64("inf")], ValueError),
                             ([one] * (DIMENSIONS - 1) + [np.float64(4e38)], ValueError),
                             ([np.float32(0.0)] * DIMENSIONS, ValueError),
                             ([one] * (DIMENSIONS - 1) + [np.bool_(True)], TypeError),
                             ([one] * (DIMENSIONS - 1) + [np.complex64(1)], TypeError),
                             ([one] * (DIMENSIONS - 1) + [None], TypeError),
                             ([one] * (DIMENSIONS - 1) + ["1"], TypeError)]:  # fmt: skip
        with pytest.raises(error):
            run(memory_store.upsert_long_term_memory(mem("bad"), embedding=embedding))
        with pytest.raises(error):
            run(memory_store.search_long_term_memory_vector("u1", embedding))
    assert ids(run(memory_store.list_long_term_memories("u1"))) == ["f32", "i64"]


def test_text_search_needs_every_word_and_reads_tags_and_data(memory_store):
    run(memory_store.upsert_long_term_memory(mem("m1", text="User prefers Python examples", updated=1)))
    run(memory_store.upsert_long_term_memory(mem("m2", text="Likes dark theme", tags=["python"], updated=2)))
    run(memory_store.upsert_long_term_memory(mem("m3", text="unrelated", data={"lang": "Python", "ide": "vim"})))
    run(memory_store.upsert_long_term_memory(mem("m4", text="python python", user="u2")))
    run(memory_store.upsert_long_term_memory(mem("m5", text="python", scope="other")))
    assert set(ids(run(memory_store.search_long_term_memory_text("u1", "python")))) == {"m1", "m2", "m3", "m5"}
    assert ids(run(memory_store.search_long_term_memory_text("u1", "PYTHON examples!"))) == ["m1"]
    assert ids(run(memory_store.search_long_term_memory_text("u1", "python vim"))) == ["m3"]
    assert ids(run(memory_store.search_long_term_memory_text("u1", "python", scope="other"))) == ["m5"]
    assert run(memory_store.search_long_term_memory_text("u1", "   ")) == []
    assert run(memory_store.search_long_term_memory_text("u1", "java")) == []
    assert len(run(memory_store.search_long_term_memory_text("u1", "python", limit=2))) == 2


@pytest.mark.parametrize("query", ["alice", "example", "python", "5", "bin", "7"])
def test_text_search_finds_the_words_inside_addresses_numbers_and_paths(memory_store, query):
    """Words are letters and digits everywhere: PostgreSQL's parser kept an e-mail address, a
    host name, a decimal number and a path as one token each, which no query word matched."""
    text = "Write to alice@example.com about version 3.5 on docs.python.org, files in /usr/bin"
    run(memory_store.upsert_long_term_memory(mem("m1", text=text, data={"delta": -7})))
    assert ids(run(memory_store.search_long_term_memory_text("u1", query))) == ["m1"]


def test_text_search_keeps_combining_marks_in_words(memory_store):
    """A Devanagari vowel sign or virama split the word it is part of: "हिन्दी" was indexed and
    searched as "ह न द", and a query for it matched "है न दो" ("is, no, two"), first."""
    run(memory_store.upsert_long_term_memory(mem("hindi", text="हिन्दी भाषा", updated=1)))
    run(memory_store.upsert_long_term_memory(mem("other", text="है न दो", updated=2)))
    run(memory_store.upsert_long_term_memory(mem("tamil", text="தமிழ் மொழி", updated=3)))
    assert ids(run(memory_store.search_long_term_memory_text("u1", "हिन्दी"))) == ["hindi"]
    assert ids(run(memory_store.search_long_term_memory_text("u1", "न"))) == ["other"]
    assert ids(run(memory_store.search_long_term_memory_text("u1", "தமிழ்"))) == ["tamil"]


@pytest.mark.parametrize("query", ["İstanbul", "İSTANBUL", "istanbul", "ISTANBUL"])
def test_text_search_finds_a_dotted_capital_i_as_i(memory_store, query):
    """Python lower-cases "İ" to "i" and a combining dot: the in-memory and Redis stores found
    "İstanbul" by no query at all, PostgreSQL not by "istanbul"."""
    run(memory_store.upsert_long_term_memory(mem("city", text="Trip to İstanbul")))
    assert ids(run(memory_store.search_long_term_memory_text("u1", query))) == ["city"]


@pytest.mark.parametrize("query", ["café", "cafe\u0301", "CAFÉ"])
def test_text_search_finds_an_accent_however_it_was_typed(memory_store, query):
    """An "é" is one code point, or "e" and a combining accent (NFD, as macOS file names have it)."""
    run(memory_store.upsert_long_term_memory(mem("composed", text="café au lait", updated=1)))
    run(memory_store.upsert_long_term_memory(mem("decomposed", text="cafe\u0301 noir", updated=2)))
    assert ids(run(memory_store.search_long_term_memory_text("u1", query))) == ["decomposed", "composed"]


@pytest.mark.parametrize(
    ("text", "query"),
    [("ΟΔΟΣ.ΑΒΓ", "ΟΔΟΣ"), ("ΟΔΟΣ.ΑΒΓ", "οδος"), ("J\u030cABC", "J\u030cABC"), ("J\u030cABC", "ǰabc"),
     ("葛\U000e0100城", "葛"), ("press 1\ufe0f\u20e3", "1")],
)  # fmt: skip
def test_text_search_finds_each_word_by_its_own_spelling(memory_store, text, query):
    """Each word lower-cased on its own and composed: lower-casing the whole text made
    "ΟΔΟΣ.ΑΒΓ" "οδοσ" (a final sigma chosen past the full stop), and "J̌" lower-cased to a
    letter and a caron that compose. A variation selector or keycap is no part of a word."""
    run(memory_store.upsert_long_term_memory(mem("m", text=text)))
    assert ids(run(memory_store.search_long_term_memory_text("u1", query))) == ["m"]


def test_text_search_reads_a_long_memorys_first_words_on_every_backend(memory_store):
    """PostgreSQL holds at most 1 MB in a text search vector: a memory of 80,000 distinct words
    was refused there with a database error. Every backend reads the same first 256 KiB."""
    words = [f"w{n}" for n in range(80_000)]
    run(memory_store.upsert_long_term_memory(mem("long", text=" ".join(words))))
    assert ids(run(memory_store.search_long_term_memory_text("u1", "w1"))) == ["long"]
    assert ids(run(memory_store.search_long_term_memory_text("u1", "w79999"))) == []  # past the first 256 KiB
    assert run(memory_store.list_long_term_memories("u1"))[0].text == " ".join(words)  # kept whole


def test_text_search_takes_at_most_max_query_terms_distinct_words(memory_store):
    """Ranking a match costs more with every word of the query (PostgreSQL's ts_rank_cd about
    with their square: 900 words kept it busy eleven minutes over three memories of 256 KiB;
    past 1,000, SQLite's ranking expression was too deep, a 500 through the API)."""
    words = [f"w{n}" for n in range(MAX_QUERY_TERMS + 1)]
    run(memory_store.upsert_long_term_memory(mem("m1", text=" ".join(words))))
    repeated = " ".join(words[:MAX_QUERY_TERMS] + words[:5] + ["W1"])  # a word twice counts once
    assert ids(run(memory_store.search_long_term_memory_text("u1", repeated))) == ["m1"]
    with pytest.raises(ValueError, match=f"query has {MAX_QUERY_TERMS + 1} distinct words.*at most {MAX_QUERY_TERMS}"):
        run(memory_store.search_long_term_memory_text("u1", " ".join(words)))


def test_text_search_ranks_the_denser_match_first(memory_store):
    run(memory_store.upsert_long_term_memory(mem("thin", text="generators " + "filler words here " * 20, updated=5)))
    run(memory_store.upsert_long_term_memory(mem("dense", text="generators generators generators", updated=1)))
    assert ids(run(memory_store.search_long_term_memory_text("u1", "generators"))) == ["dense", "thin"]


def test_text_search_ranks_by_the_count_of_the_query_words(memory_store):
    """Each memory by how many times it holds the query's words, tags and data included, then
    newest, then id: SQLite ranked with FTS5's bm25, which put the short "green tea" above a
    long memory with the word twice, from statistics over every account's memories."""
    run(memory_store.upsert_long_term_memory(mem("adjacent", text="tea tea tea", updated=1)))
    run(memory_store.upsert_long_term_memory(mem("apart", text="tea coffee tea", updated=3)))
    long = "tea then milk then sugar then more tea stirred slowly with honey"
    run(memory_store.upsert_long_term_memory(mem("long", text=long, updated=2)))
    run(memory_store.upsert_long_term_memory(mem("green", text="green tea", updated=4)))
    run(memory_store.upsert_long_term_memory(mem("tagged", text="green tea", tags=["green"], updated=0)))
    expected = ["adjacent", "apart", "long", "green", "tagged"]
    assert ids(run(memory_store.search_long_term_memory_text("u1", "tea"))) == expected
    assert ids(run(memory_store.search_long_term_memory_text("u1", "tea", limit=2))) == expected[:2]
    assert ids(run(memory_store.search_long_term_memory_text("u1", "green tea"))) == ["tagged", "green"]


def test_vector_search_matches_numpy_cosine(memory_store):
    rng = random.Random(7)
    vectors = {f"m{i}": [rng.uniform(-1, 1) for _ in range(DIMENSIONS)] for i in range(40)}
    for i, (ident, vector) in enumerate(vectors.items()):
        user = "u1" if i % 4 else "u2"
        run(memory_store.upsert_long_term_memory(mem(ident, user=user, text=ident), embedding=vector))
    run(memory_store.upsert_long_term_memory(mem("no-vector")))
    query = [rng.uniform(-1, 1) for _ in range(DIMENSIONS)]

    stored = {k: np.asarray(v, dtype=np.float32).astype(np.float64) for k, v in vectors.items()}
    q = np.asarray(query, dtype=np.float32).astype(np.float64)
    expected = sorted(
        ((k, float(v @ q / np.linalg.norm(v) / np.linalg.norm(q))) for i, (k, v) in enumerate(stored.items()) if i % 4),
        key=lambda kv: -kv[1],
    )
    hits = run(memory_store.search_long_term_memory_vector("u1", query, limit=10))
    assert [m.id for m, _ in hits] == [k for k, _ in expected[:10]]
    assert [s for _, s in hits] == pytest.approx([s for _, s in expected[:10]], abs=1e-5)
    assert all(m.user_id == "u1" for m, _ in hits)

    floor = expected[3][1] - 1e-6
    above = run(memory_store.search_long_term_memory_vector("u1", query, limit=10, min_score=floor))
    assert [m.id for m, _ in above] == [k for k, _ in expected[:4]]
    assert run(memory_store.search_long_term_memory_vector("u1", query, scope="nope")) == []
    with pytest.raises(ValueError, match="dimensions"):
        run(memory_store.search_long_term_memory_vector("u1", query[:-1]))
    with pytest.raises(TypeError):
        run(memory_store.search_long_term_memory_vector("u1", query, min_score="high"))


def test_similarity_is_within_one_and_a_memorys_own_vector_scores_exactly_one(memory_store):
    """As on PostgreSQL, whose pgvector clips to [-1, 1]: the in-memory, SQLite and Redis
    stores scored a memory's own vector 1 +- 2e-16 (norm x norm rounds), so ``min_score=1.0``
    missed exact duplicates on some backends, and nearly parallel vectors scored past 1."""
    vectors = np.random.default_rng(11).normal(size=(30, DIMENSIONS)).astype(np.float32)
    for i, vector in enumerate(vectors):
        run(memory_store.upsert_long_term_memory(mem(f"m{i:02d}"), embedding=vector))
        # Not quite parallel once rounded to float32: scored up to 1 + 2e-16 against ``vector``.
        run(memory_store.upsert_long_term_memory(mem(f"s{i:02d}"), embedding=vector * np.float32(3.3)))
    search = memory_store.search_long_term_memory_vector
    for i, vector in enumerate(vectors):
        ident = f"m{i:02d}"
        everything = run(search("u1", vector, limit=len(vectors) * 2))
        assert dict((m.id, s) for m, s in everything)[ident] == 1.0
        assert all(-1.0 <= s <= 1.0 for _, s in everything)
        duplicates = run(search("u1", vector, min_score=1.0))
        assert ident in ids(m for m, _ in duplicates) and all(s == 1.0 for _, s in duplicates)
        opposite = run(search("u1", -vector, limit=len(vectors) * 2, min_score=-1.0))
        assert dict((m.id, s) for m, s in opposite)[ident] == -1.0
        assert all(-1.0 <= s <= 1.0 for _, s in opposite)


def test_capabilities_are_declared(memory_store):
    caps = memory_store.capabilities
    assert caps.text_search and caps.vector_search and caps.atomic_upsert


def test_async_context_manager(memory_store):
    async def use():
        async with memory_store as store:
            await store.put_state("t1", "k", 1)
            return await store.get_state("t1", "k")

    assert run(use()) == 1


def test_state_retention_prunes_old_runs_and_keeps_the_rest(memory_store):
    for run_index in range(4):
        run_id = f"run-{run_index}"
        for step in range(3):
            run(memory_store.write_checkpoint("t1", run_id, step, "runtime_state", {"s": step}))
            run(memory_store.record_effect("t1", run_id, step, f"call-{step}", input_hash="h", output=step))
        run(memory_store.put_state("t1", f"checkpoint:{run_id}:latest", {
            "run_id": run_id, "step": 2, "phase": "runtime_state", "timestamp_ms": 1000 + run_index,
            "key": f"checkpoint:{run_id}:2:runtime_state",
        }))  # fmt: skip
    run(memory_store.put_state("t1", "checkpoint:orphan:0:pre_llm", {}))  # a run without a latest pointer
    run(memory_store.put_state("t1", "notes", "kept"))
    run(memory_store.append_event(ev(1)))
    policy = StateRetentionPolicy(
        max_runs=2, max_runtime_states_per_run=1, max_effect_entries_per_run=2, always_keep_phases=[]
    )
    result = run(compact_thread(memory_store, thread_id="t1", state_policy=policy))
    assert sorted(run(memory_store.list_state("t1"))) == [
        "checkpoint:run-2:2:runtime_state",
        "checkpoint:run-2:latest",
        "checkpoint:run-3:2:runtime_state",
        "checkpoint:run-3:latest",
        "effect:run-2:1:call-1",
        "effect:run-2:2:call-2",
        "effect:run-3:1:call-1",
        "effect:run-3:2:call-2",
        "notes",
    ]
    assert (result.state_keys_before, result.state_keys_after, result.state_keys_removed) == (30, 9, 21)
    assert result.events_after == 1  # events were compacted with the default policy, nothing to drop
    with pytest.raises(TypeError):
        run(compact_thread(memory_store, thread_id="t1", state_policy={"max_runs": 1}))


@pytest.mark.parametrize("limits", [{"max_runs": 0}, {"max_runtime_states_per_run": 0, "always_keep_phases": []}])
def test_a_state_policy_of_zero_keeps_one_as_afk_does(memory_store, limits):
    """AFK's apply_state_retention keeps at least one run, runtime state and effect of each
    limit: max_runs=0 deleted the newest run's checkpoints and pointer, so it could not resume."""
    for step in range(2):
        run(memory_store.write_checkpoint("t1", "run-1", step, "runtime_state", {"step": step}))
    run(memory_store.put_state("t1", "effect:run-1:1:call", {"output": 1}))
    policy = StateRetentionPolicy(max_effect_entries_per_run=0, **limits)
    run(compact_thread(memory_store, thread_id="t1", state_policy=policy))
    latest = run(memory_store.latest_checkpoint("t1", "run-1"))
    assert latest is not None and latest.payload == {"step": 1}
    assert run(memory_store.get_state("t1", "effect:run-1:1:call")) == {"output": 1}


def test_compact_thread_refuses_what_is_not_a_retention_policy_and_changes_nothing(memory_store):
    for n in range(3):
        run(memory_store.append_event(MemoryEvent(f"e{n}", "t1", None, "message", n, {}, [])))
    for thread in ("t1", "empty"):  # an AttributeError with events, a silent success without
        with pytest.raises(TypeError, match="RetentionPolicy"):
            run(memory_store.compact_thread(thread, {"max_events_per_thread": 1}))
    assert len(run(memory_store.get_recent_events("t1", 10))) == 3


def test_compact_state_refuses_what_is_not_a_state_policy_and_changes_nothing(memory_store):
    run(memory_store.write_checkpoint("t1", "run-1", 0, "pre_llm", {}))
    with pytest.raises(TypeError, match="StateRetentionPolicy"):
        run(memory_store.compact_state("t1", {"max_runs": 0}))
    assert len(run(memory_store.list_state("t1"))) == 2
