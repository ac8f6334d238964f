"""``InMemoryMemoryStore``: the reference backend, kept in process memory."""

from __future__ import annotations

import bisect
import copy
import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from .base import MemoryStore, check_limit
from .compaction import check_policy, retained
from .text import query_terms, rank_by_term_count
from .types import (
    DuplicateEventError,
    Embedding,
    JsonValue,
    LongTermMemory,
    MemoryCapabilities,
    MemoryCompactionResult,
    MemoryEvent,
    RetentionPolicy,
    check_count,
    check_embedding,
    check_id,
    check_min_score,
    check_prefix,
    check_replacement,
    check_state_entries,
    check_state_key,
    check_state_keys,
    check_timestamp,
    check_user_scope,
    cosine_similarities,
    json_round_trip,
    validate_event,
    validate_memory,
)


def _stored_event(event: MemoryEvent) -> MemoryEvent:
    """``event`` as the databases keep it: its payload JSON's copy (tuples come back as lists)."""
    return dataclasses.replace(event, payload=json_round_trip(event.payload, "event.payload")[0], tags=list(event.tags))


class InMemoryMemoryStore(MemoryStore):
    """Everything in dicts: fast, no setup, gone on restart. The oracle the tests trust.

    Each method runs without awaiting in between its reads and writes, so on one event
    loop every operation is atomic. ``embedding_dimensions`` (None: any length, but one
    length per store) is checked like the database backends check theirs.
    """

    capabilities = MemoryCapabilities(text_search=True, vector_search=True, atomic_upsert=True, ttl=False)

    def __init__(self, *, embedding_dimensions: int | None = None) -> None:
        if embedding_dimensions is not None:
            check_count(embedding_dimensions, "embedding_dimensions", minimum=1)
        self.embedding_dimensions = embedding_dimensions
        self._seq = itertools.count()
        self._events: dict[str, list[tuple[tuple[int, int], MemoryEvent]]] = {}
        self._state: dict[str, dict[str, JsonValue]] = {}
        self._memories: dict[str, tuple[LongTermMemory, list[float] | None]] = {}

    # -- events ------------------------------------------------------------------------------

    async def append_event(self, event: MemoryEvent) -> None:
        validate_event(event)
        events = self._events.setdefault(event.thread_id, [])
        if any(stored.id == event.id for _, stored in events):
            raise DuplicateEventError(event.id, event.thread_id)
        bisect.insort(events, ((event.timestamp, next(self._seq)), _stored_event(event)), key=lambda e: e[0])

    async def get_recent_events(self, thread_id: str, limit: int = 50) -> list[MemoryEvent]:
        check_id(thread_id, "thread_id")
        check_limit(limit)
        events = self._events.get(thread_id, [])
        return [copy.deepcopy(e) for _, e in events[max(len(events) - limit, 0) :]]

    async def get_events_since(self, thread_id: str, since_ms: int, limit: int = 500) -> list[MemoryEvent]:
        check_id(thread_id, "thread_id")
        check_timestamp(since_ms, "since_ms")
        check_limit(limit)
        return [copy.deepcopy(e) for _, e in self._events.get(thread_id, []) if e.timestamp >= since_ms][:limit]

    async def replace_thread_events(self, thread_id: str, events: list[MemoryEvent]) -> None:
        events = check_replacement(thread_id, events)
        self._events[thread_id] = sorted(
            (((e.timestamp, next(self._seq)), _stored_event(e)) for e in events), key=lambda e: e[0]
        )

    async def compact_thread(self, thread_id: str, policy: RetentionPolicy) -> MemoryCompactionResult:
        check_id(thread_id, "thread_id")
        check_policy(policy, RetentionPolicy, "policy")
        events = self._events.get(thread_id, [])
        window = events[max(len(events) - policy.scan_limit, 0) :]
        keep = retained([(order, e.type) for order, e in window], policy)
        self._events[thread_id] = [item for item in window if item[0] in keep]
        after = len(self._events[thread_id])
        return MemoryCompactionResult(len(events), after, len(events) - after)

    # -- state -------------------------------------------------------------------------------

    async def put_state(self, thread_id: str, key: str, value: JsonValue) -> None:
        await self.put_state_many(thread_id, {key: value})  # checked as the other backends check it

    async def put_state_many(self, thread_id: str, entries: dict[str, JsonValue]) -> None:
        check_id(thread_id, "thread_id")
        check_state_entries(entries)
        self._state.setdefault(thread_id, {}).update(
            {key: json_round_trip(value, key)[0] for key, value in entries.items()}
        )

    async def delete_state_many(self, thread_id: str, keys: Sequence[str]) -> None:
        check_id(thread_id, "thread_id")
        keys = check_state_keys(keys)
        state = self._state.get(thread_id, {})
        for key in keys:
            state.pop(key, None)

    async def get_state(self, thread_id: str, key: str) -> JsonValue | None:
        check_id(thread_id, "thread_id")
        check_state_key(key)
        return copy.deepcopy(self._state.get(thread_id, {}).get(key))

    async def list_state(self, thread_id: str, prefix: str | None = None) -> dict[str, JsonValue]:
        check_id(thread_id, "thread_id")
        check_prefix(prefix)
        state = self._state.get(thread_id, {})
        return {k: copy.deepcopy(state[k]) for k in sorted(state) if prefix is None or k.startswith(prefix)}

    async def delete_state(self, thread_id: str, key: str) -> None:
        check_id(thread_id, "thread_id")
        check_state_key(key)
        self._state.get(thread_id, {}).pop(key, None)

    # -- long-term memory --------------------------------------------------------------------

    async def upsert_long_term_memory(self, memory: LongTermMemory, *, embedding: Embedding | None = None) -> None:
        validate_memory(memory)
        vector = None
        if embedding is not None:
            vector = check_embedding(embedding, "embedding", self.embedding_dimensions)
            if self.embedding_dimensions is None:
                self.embedding_dimensions = len(vector)
        # Kept as the databases keep it: JSON's copy (tuples come back as lists).
        stored = dataclasses.replace(
            memory,
            data=json_round_trip(memory.data, "memory.data")[0],
            tags=list(memory.tags),
            metadata=json_round_trip(memory.metadata, "memory.metadata")[0],
        )
        previous = self._memories.get(memory.id)
        if previous is not None:
            stored.created_at = previous[0].created_at
            if vector is None:
                vector = previous[1]
        self._memories[memory.id] = (stored, vector)

    async def delete_long_term_memory(self, user_id: str | None, memory_id: str) -> None:
        check_id(user_id, "user_id", optional=True)
        check_id(memory_id, "memory_id")
        found = self._memories.get(memory_id)
        if found is not None and found[0].user_id == user_id:
            del self._memories[memory_id]

    async def delete_long_term_memories(self, user_id: str | None, *, scope: str | None = None) -> int:
        doomed = [memory.id for memory, _ in self._owned(user_id, scope)]
        for memory_id in doomed:
            del self._memories[memory_id]
        return len(doomed)

    def _owned(self, user_id: str | None, scope: str | None) -> list[tuple[LongTermMemory, list[float] | None]]:
        check_user_scope(user_id, scope)
        return [
            (m, v) for m, v in self._memories.values() if m.user_id == user_id and (scope is None or m.scope == scope)
        ]

    async def list_long_term_memories(
        self, user_id: str | None, *, scope: str | None = None, limit: int = 100
    ) -> list[LongTermMemory]:
        check_limit(limit)
        found = sorted(self._owned(user_id, scope), key=lambda mv: (-mv[0].updated_at, mv[0].id))
        return [copy.deepcopy(m) for m, _ in found[:limit]]

    async def search_long_term_memory_text(
        self, user_id: str | None, query: str, *, scope: str | None = None, limit: int = 20
    ) -> list[LongTermMemory]:
        check_limit(limit)
        terms = query_terms(query)
        owned = self._owned(user_id, scope)
        if not terms:
            return []
        return [copy.deepcopy(m) for m in rank_by_term_count((m for m, _ in owned), terms, limit)]

    async def search_long_term_memory_vector(
        self,
        user_id: str | None,
        query_embedding: Embedding,
        *,
        scope: str | None = None,
        limit: int = 20,
        min_score: float | None = None,
    ) -> list[tuple[LongTermMemory, float]]:
        check_limit(limit)
        floor = check_min_score(min_score)
        query = np.asarray(check_embedding(query_embedding, "query_embedding", self.embedding_dimensions))
        candidates = [(m, v) for m, v in self._owned(user_id, scope) if v is not None]
        if not candidates:
            return []
        scores = cosine_similarities(np.asarray([v for _, v in candidates]), query)
        ranked = sorted(zip(candidates, scores.tolist(), strict=True), key=lambda cs: (-cs[1], cs[0][0].id))
        return [(copy.deepcopy(m), score) for (m, _), score in ranked if floor is None or score >= floor][:limit]
