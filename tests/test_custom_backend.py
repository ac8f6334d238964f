"""A backend written as AFK's "Custom backends" shows: only the listed methods, the rest from ``MemoryStore``."""

from __future__ import annotations

import pytest

from afkmemory.memory import (
    InMemoryMemoryStore,
    JsonValue,
    LongTermMemory,
    MemoryCapabilities,
    MemoryEvent,
    MemoryStore,
    RetentionPolicy,
    compact_thread,
)
from tests.utils import run


class DictMemoryStore(MemoryStore):
    """The spec's ``MyMemoryStore``: exactly the methods it lists, kept in dicts."""

    capabilities = MemoryCapabilities(text_search=True, vector_search=False, atomic_upsert=True, ttl=False)

    def __init__(self) -> None:
        self.events: dict[str, list[MemoryEvent]] = {}
        self.state: dict[str, dict[str, JsonValue]] = {}
        self.memories: dict[str, LongTermMemory] = {}
        self.replacements = 0

    async def setup(self) -> None:
        await super().setup()

    async def close(self) -> None:
        await super().close()

    async def append_event(self, event: MemoryEvent) -> None:
        self.events.setdefault(event.thread_id, []).append(event)

    async def get_recent_events(self, thread_id: str, limit: int = 50) -> list[MemoryEvent]:
        events = sorted(self.events.get(thread_id, []), key=lambda e: e.timestamp)  # stable: insertion order
        return events[max(len(events) - limit, 0) :]

    async def get_events_since(self, thread_id: str, since_ms: int, limit: int = 500) -> list[MemoryEvent]:
        return [e for e in await self.get_recent_events(thread_id, 10**9) if e.timestamp >= since_ms][:limit]

    async def put_state(self, thread_id: str, key: str, value: JsonValue) -> None:
        self.state.setdefault(thread_id, {})[key] = value

    async def get_state(self, thread_id: str, key: str) -> JsonValue | None:
        return self.state.get(thread_id, {}).get(key)

    async def list_state(self, thread_id: str, prefix: str | None = None) -> dict[str, JsonValue]:
        state = self.state.get(thread_id, {})
        return {k: state[k] for k in sorted(state) if prefix is None or k.startswith(prefix)}

    async def delete_state(self, thread_id: str, key: str) -> None:
        self.state.get(thread_id, {}).pop(key, None)

    async def replace_thread_events(self, thread_id: str, events: list[MemoryEvent]) -> None:
        self.replacements += 1
        self.events[thread_id] = list(events)

    async def upsert_long_term_memory(self, memory: LongTermMemory, *, embedding=None) -> None:
        self.memories[memory.id] = memory

    async def delete_long_term_memory(self, user_id: str | None, memory_id: str) -> None:
        if memory_id in self.memories and self.memories[memory_id].user_id == user_id:
            del self.memories[memory_id]

    async def list_long_term_memories(
        self, user_id: str | None, *, scope: str | None = None, limit: int = 100
    ) -> list[LongTermMemory]:
        found = [m for m in self.memories.values() if m.user_id == user_id and scope in (None, m.scope)]
        return sorted(found, key=lambda m: (-m.updated_at, m.id))[:limit]


def both() -> tuple[DictMemoryStore, InMemoryMemoryStore]:
    return DictMemoryStore(), InMemoryMemoryStore()


def test_a_backend_with_only_the_listed_methods_can_be_made():
    """``compact_thread`` was abstract: the spec's example raised TypeError when instantiated."""
    store = DictMemoryStore()
    run(store.setup())
    assert isinstance(store, MemoryStore)
    run(store.close())


POLICIES = [
    RetentionPolicy(max_events_per_thread=5),
    RetentionPolicy(max_events_per_thread=3, keep_event_types=["trace", "system"]),  # more protected than budget
    RetentionPolicy(max_events_per_thread=8, scan_limit=6),  # older than the window: removed
    RetentionPolicy(max_events_per_thread=0),
]


@pytest.mark.parametrize("policy", POLICIES)
def test_compaction_keeps_what_the_in_memory_store_keeps(policy):
    kinds = ["message", "trace", "tool_call", "system", "tool_result", "trace", "message", "system"]
    results, kept = [], []
    for store in both():
        for i in range(20):
            # Equal timestamps in pairs: their insertion order decides which is newer.
            event = MemoryEvent(f"e{i}", "t1", "u1", kinds[i % len(kinds)], i // 2, {"n": i}, [])
            run(store.append_event(event))
        results.append(run(compact_thread(store, thread_id="t1", event_policy=policy)))
        kept.append([e.id for e in run(store.get_recent_events("t1", 100))])
    assert results[0] == results[1]
    assert kept[0] == kept[1]
    assert results[0].events_before == 20
    assert results[0].events_removed == 20 - len(kept[0]) > 0


def test_compaction_that_removes_nothing_writes_nothing_and_checks_its_arguments():
    store = DictMemoryStore()
    for i in range(3):
        run(store.append_event(MemoryEvent(f"e{i}", "t1", "u1", "message", i, {}, [])))
    result = run(compact_thread(store, thread_id="t1"))
    assert (result.events_before, result.events_after, result.events_removed) == (3, 3, 0)
    assert run(compact_thread(store, thread_id="empty")).events_before == 0
    assert store.replacements == 0
    with pytest.raises(TypeError, match="policy must be a RetentionPolicy"):
        run(store.compact_thread("t1", {"max_events_per_thread": 1}))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        run(store.compact_thread("", RetentionPolicy(max_events_per_thread=1)))
    assert [e.id for e in run(store.get_recent_events("t1"))] == ["e0", "e1", "e2"]


def test_text_search_finds_and_ranks_what_the_in_memory_store_does():
    memories = [
        LongTermMemory("dense", "u1", "knowledge", {}, "python generators generators", [], {}, 1, 1),
        LongTermMemory("thin", "u1", "knowledge", {}, "generators in Python", [], {}, 1, 5),
        LongTermMemory("tagged", "u1", "prefs", {"lang": "Python"}, "likes generators", ["py"], {}, 1, 3),
        LongTermMemory("other", "u2", "knowledge", {}, "python generators", [], {}, 1, 9),
        LongTermMemory("none", None, "knowledge", {}, "python", [], {}, 1, 9),
    ]
    queries = [
        ("u1", "python generators", None, 20),
        ("u1", "GENERATORS", None, 2),
        ("u1", "python", "prefs", 20),
        ("u2", "python", None, 20),
        (None, "python", None, 20),
        ("u1", "java", None, 20),
    ]
    found: list[list[list[str]]] = []
    for store in both():
        for memory in memories:
            run(store.upsert_long_term_memory(memory))
        found.append([
            [m.id for m in run(store.search_long_term_memory_text(user, query, scope=scope, limit=limit))]
            for user, query, scope, limit in queries
        ])  # fmt: skip
    assert found[0] == found[1]
    assert found[0][0] == ["dense", "thin", "tagged"]  # most occurrences, then newest
    store = DictMemoryStore()
    run(store.upsert_long_term_memory(memories[0]))
    assert run(store.search_long_term_memory_text("u1", "  ?! ")) == []
    with pytest.raises(ValueError):
        run(store.search_long_term_memory_text("u1", "python", limit=-1))
    with pytest.raises(TypeError):
        run(store.search_long_term_memory_text("u1", None))  # type: ignore[arg-type]
