"""Bad input to the Python API: a clear TypeError/ValueError, nothing written, every backend alike.

From a review feeding each public method bad input; each test failed before its fix.
"""

from __future__ import annotations

import time

import pytest
from agentflow.checkpoint import Checkpoint
from agentflow.errors import CheckpointError

from afkmemory.memory import InMemoryMemoryStore, LongTermMemory, MemoryEvent
from afkmemory.models import GraphCheckpoint, StoreItem
from afkmemory.stores import DjangoCheckpointer, DjangoStore, SyncDjangoMemoryStore
from afkmemory.stores import memory as memory_store_module
from tests.conftest import DIMENSIONS, DJANGO_ALIASES
from tests.utils import run

pytestmark = pytest.mark.django_db(databases=list(DJANGO_ALIASES.values()))


def ev(i, thread="t1", payload=None):
    return MemoryEvent(f"e{i}", thread, "u1", "message", i, {"n": i} if payload is None else payload, [])


def mem(ident="m1"):
    return LongTermMemory(ident, "u1", "s", {}, "hello", [], {}, 1, 1)


def deep(n):
    value: list = []
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize("prefix", ["\x00", "a\x00", "checkpoint:r\x00:", "\ud800", "effect:\ud800"])
def test_list_state_refuses_a_prefix_with_nul_or_lone_surrogate(memory_store, prefix):
    """list_state never checks its prefix with check_text, so the backends answer differently:
    a NUL is django.db.utils.DataError on PostgreSQL ("PostgreSQL text fields cannot contain NUL")
    but {} on SQLite, in-memory and Redis; a lone surrogate is a raw UnicodeEncodeError from the
    driver on SQLite, PostgreSQL and Redis but {} in memory. Every other text argument is refused
    with check_text's ValueError ("must not contain NUL" / "lone surrogate")."""
    run(memory_store.put_state("t1", "a", 1))
    with pytest.raises(ValueError, match="NUL characters|lone surrogate at"):
        run(memory_store.list_state("t1", prefix))


@pytest.mark.parametrize("depth", [100_000])
def test_deeply_nested_json_is_a_value_error(memory_store, depth):
    """JSON nested deeper than the interpreter's recursion limit escapes as RecursionError
    (from _walk_json / json.dumps) on every backend, instead of a ValueError naming the depth."""
    with pytest.raises(ValueError, match="nest|deep"):
        run(memory_store.append_event(ev(1, payload={"x": deep(depth)})))
    with pytest.raises(ValueError, match="nest|deep"):
        run(memory_store.put_state("t1", "k", {"x": deep(depth)}))
    assert run(memory_store.get_recent_events("t1")) == []
    assert run(memory_store.list_state("t1")) == {}


def test_json_past_the_depth_limit_is_refused_alike_by_every_backend(memory_store):
    """950 levels: Redis stored it, the Django stores raised RecursionError, and the in-memory
    store kept it and then could not read the thread (copy.deepcopy). Now every backend refuses
    what is past MAX_JSON_DEPTH, the REST API's limit too, and takes what is within it."""
    from afkmemory.memory.types import MAX_JSON_DEPTH

    with pytest.raises(ValueError, match=f"event.payload is nested deeper than {MAX_JSON_DEPTH} levels"):
        run(memory_store.append_event(ev(1, payload={"x": deep(MAX_JSON_DEPTH)})))
    run(memory_store.append_event(ev(2, payload={"x": deep(MAX_JSON_DEPTH - 2)})))
    assert [e.id for e in run(memory_store.get_recent_events("t1"))] == ["e2"]


@pytest.mark.parametrize("which", ["store", "checkpointer"])
@pytest.mark.parametrize("alias", list(DJANGO_ALIASES.values()))
def test_store_and_checkpointer_refuse_deep_json_with_a_value_error(alias, which):
    """DjangoStore.put and DjangoCheckpointer.put let RecursionError escape for deeply nested
    values (json_round_trip / check_json catch only TypeError and ValueError)."""
    if which == "store":
        with pytest.raises(ValueError, match="nested deeper"):
            run(DjangoStore(using=alias).put(("a",), "k", {"x": deep(100_000)}))
        assert not StoreItem.objects.using(alias).exists()
    else:
        with pytest.raises(CheckpointError, match="nested deeper"):
            run(DjangoCheckpointer(using=alias).put(Checkpoint("t", 1, {"x": deep(100_000)})))
        assert not GraphCheckpoint.objects.using(alias).exists()


def test_replace_thread_events_takes_a_generator_on_every_backend(memory_store):
    """The in-memory store's validation loop used up a generator, so the thread was replaced by
    nothing (e1 lost, silently); the others raised TypeError (no len()). Now each reads it once."""
    run(memory_store.append_event(ev(1)))
    run(memory_store.replace_thread_events("t1", (e for e in [ev(2), ev(3)])))
    assert [e.id for e in run(memory_store.get_recent_events("t1"))] == ["e2", "e3"]


def test_an_embedding_holding_a_huge_int_is_a_value_error(memory_store):
    """check_embedding calls math.isfinite(x) before the float32 range check: an int past any
    float (10**400) raises OverflowError("int too large to convert to float") on every backend,
    for upsert_long_term_memory and search_long_term_memory_vector alike."""
    embedding = [10**400] + [1] * (DIMENSIONS - 1)
    with pytest.raises(ValueError, match="float32"):
        run(memory_store.upsert_long_term_memory(mem(), embedding=embedding))
    with pytest.raises(ValueError, match="float32"):
        run(memory_store.search_long_term_memory_vector("u1", embedding))
    assert run(memory_store.list_long_term_memories("u1")) == []


@pytest.mark.parametrize("table_rows", [None, 1e6])
@pytest.mark.parametrize("alias", list(DJANGO_ALIASES.values()))
def test_fused_search_takes_the_largest_limit(alias, table_rows, monkeypatch):
    """search_long_term_memory_fused with both a query and an embedding passes limit * 4 to the
    vector and text searches: limit=2**63 - 1 (valid everywhere else) is refused with
    "ValueError: limit must be at most 2**63 - 1 ..., got 36893488147419103228", a number the
    caller never gave. On PostgreSQL with a big memory table (the planner's estimate, cached),
    the vector search's exact-ranking threshold grew past a bigint: "bigint out of range"."""
    if table_rows is not None:
        stats = memory_store_module._TableStats(table_rows, hnsw=True)
        monkeypatch.setitem(memory_store_module._TABLE_ROWS, alias, (time.monotonic(), stats))
    store = SyncDjangoMemoryStore(using=alias)
    store.upsert_long_term_memory(mem(), embedding=[1.0] * DIMENSIONS)
    out = store.search_long_term_memory_fused("u1", query="hello", query_embedding=[1.0] * DIMENSIONS, limit=2**63 - 1)
    assert [m.id for m, *_ in out] == ["m1"]


@pytest.mark.parametrize("older_than", ["2020\x00", "\ud800"])
@pytest.mark.parametrize("alias", list(DJANGO_ALIASES.values()))
def test_prune_refuses_older_than_with_nul_or_lone_surrogate(alias, older_than):
    """prune only checks that older_than is a str. With a NUL, PostgreSQL raises
    django.db.utils.DataError while SQLite silently deletes (ts "2019" < "2020\\x00"); a lone
    surrogate is the driver's UnicodeEncodeError, raised mid-statement, which breaks the caller's
    atomic block (the next query is TransactionManagementError)."""
    checkpointer = DjangoCheckpointer(using=alias)
    run(checkpointer.put(Checkpoint("t", 1, {}, ts="2019")))
    with pytest.raises(ValueError, match="NUL characters|lone surrogate at"):
        run(checkpointer.prune("t", older_than=older_than))
    assert run(checkpointer.get("t")) is not None


@pytest.mark.parametrize("dimensions", [0, -1, True, "8", 8.0])
def test_in_memory_store_checks_embedding_dimensions_like_redis(dimensions):
    """InMemoryMemoryStore(embedding_dimensions=...) accepts anything; RedisMemoryStore refuses
    0, -1, True, "8" (check_count). With "8" every later embedding of 8 numbers is refused as
    "has 8 dimensions; this store is configured for 8"."""
    with pytest.raises((TypeError, ValueError)):
        InMemoryMemoryStore(embedding_dimensions=dimensions)


@pytest.mark.parametrize("input_hash", [5, None, ""])
def test_get_effect_refuses_a_bad_input_hash(memory_store, input_hash):
    """record_effect refuses a non-string or empty input_hash (check_id), but get_effect takes
    it unchecked and returns None on every backend: a silent "not journaled"."""
    with pytest.raises((TypeError, ValueError)):
        run(memory_store.get_effect("t1", "r", 1, "c", input_hash=input_hash))


def test_an_unhashable_event_type_gets_a_clear_error(memory_store):
    """validate_event tests `event.type not in EVENT_TYPES` first: a list type raises
    TypeError("unhashable type: 'list'"), which names neither the field nor the allowed types."""
    with pytest.raises(TypeError, match="event.type"):
        run(memory_store.append_event(MemoryEvent("e1", "t1", None, ["message"], 1, {}, [])))
