"""The ``MemoryStore`` protocol every afkmemory backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from .compaction import check_policy, doomed_state, retained
from .journal import (
    CheckpointRecord,
    EffectRecord,
    check_run_id,
    checkpoint_entries,
    checkpoint_from_value,
    effect_entry,
    effect_key,
    latest_key,
    pointer_target,
    replayable_effect,
    run_checkpoints,
)
from .text import query_terms, rank_by_term_count
from .types import (
    MAX_INT64,
    Embedding,
    JsonValue,
    LongTermMemory,
    MemoryCapabilities,
    MemoryCompactionResult,
    MemoryEvent,
    RetentionPolicy,
    StateRetentionPolicy,
    check_count,
    check_id,
    check_user_scope,
    now_ms,
)


class MemoryStore(ABC):
    """Events, per-thread state, long-term memory, checkpoints and the effect journal.

    Every method is async. Ordering guarantees: events are ordered by ``(timestamp,
    insertion order)``; ``list_state`` is sorted by key; long-term memories are listed
    newest ``updated_at`` first. Bad input raises ``TypeError``/``ValueError`` and writes
    nothing.
    """

    capabilities: ClassVar[MemoryCapabilities] = MemoryCapabilities()

    async def setup(self) -> None:  # noqa: B027  (an optional hook, not abstract)
        """Prepare the backend (connect, create schema); safe to call twice."""

    async def close(self) -> None:  # noqa: B027  (an optional hook, not abstract)
        """Release the backend's resources."""

    async def __aenter__(self) -> MemoryStore:
        await self.setup()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- events ------------------------------------------------------------------------------

    @abstractmethod
    async def append_event(self, event: MemoryEvent) -> None:
        """Append ``event`` to its thread (a duplicate id in the thread is a ValueError)."""

    @abstractmethod
    async def get_recent_events(self, thread_id: str, limit: int = 50) -> list[MemoryEvent]:
        """Return the newest ``limit`` events of the thread, oldest first."""

    @abstractmethod
    async def get_events_since(self, thread_id: str, since_ms: int, limit: int = 500) -> list[MemoryEvent]:
        """Return up to ``limit`` events with ``timestamp >= since_ms``, oldest first."""

    @abstractmethod
    async def replace_thread_events(self, thread_id: str, events: list[MemoryEvent]) -> None:
        """Atomically replace every event of the thread with ``events``."""

    async def compact_thread(self, thread_id: str, policy: RetentionPolicy) -> MemoryCompactionResult:
        """Apply ``policy`` to the thread (see ``compaction.compact_thread``).

        A default, so a backend written as AFK's "Custom backends" shows (without this
        method) can be made: it reads the whole thread with ``get_recent_events``, keeps
        what ``retained`` keeps of the newest ``policy.scan_limit`` events and writes that
        back with ``replace_thread_events``. It is NOT safe against concurrent appends: an
        event appended between the read and the replace is lost. Every afkmemory backend
        overrides it with one that never deletes events appended meanwhile; a backend
        other writers append to while it compacts should too.
        """
        check_id(thread_id, "thread_id")
        check_policy(policy, RetentionPolicy, "policy")
        events = await self.get_recent_events(thread_id, limit=MAX_INT64)
        window = events[max(len(events) - policy.scan_limit, 0) :]
        keep = retained([(i, event.type) for i, event in enumerate(window)], policy)
        kept = [event for i, event in enumerate(window) if i in keep]
        if len(kept) < len(events):
            await self.replace_thread_events(thread_id, kept)
        return MemoryCompactionResult(len(events), len(kept), len(events) - len(kept))

    # -- state -------------------------------------------------------------------------------

    @abstractmethod
    async def put_state(self, thread_id: str, key: str, value: JsonValue) -> None:
        """Set one state key of the thread."""

    async def put_state_many(self, thread_id: str, entries: dict[str, JsonValue]) -> None:
        """Set several state keys of the thread; backends with transactions do it atomically."""
        for key, value in entries.items():
            await self.put_state(thread_id, key, value)

    @abstractmethod
    async def get_state(self, thread_id: str, key: str) -> JsonValue | None:
        """Return one state value of the thread, or None."""

    async def delete_state_many(self, thread_id: str, keys: Sequence[str]) -> None:
        """Delete several state keys of the thread; backends with transactions do it atomically."""
        for key in keys:
            await self.delete_state(thread_id, key)

    @abstractmethod
    async def list_state(self, thread_id: str, prefix: str | None = None) -> dict[str, JsonValue]:
        """Return the thread's state whose keys start with ``prefix``, sorted by key."""

    @abstractmethod
    async def delete_state(self, thread_id: str, key: str) -> None:
        """Delete one state key of the thread (absent keys are fine)."""

    async def compact_state(self, thread_id: str, policy: StateRetentionPolicy) -> tuple[int, int]:
        """Drop the checkpoints and effects of old runs (``policy``); return the keys before, and removed.

        The read, the decision and the deletes are one step: a key written meanwhile, new
        or rewritten (a resumed run moving its latest pointer), is never removed. This
        default is that where no other call runs between its awaits (the in-memory store);
        a backend other processes share overrides it with a transaction.
        """
        check_id(thread_id, "thread_id")
        state = await self.list_state(thread_id)
        doomed = doomed_state(state, policy)
        await self.delete_state_many(thread_id, doomed)
        return len(state), len(doomed)

    # -- long-term memory --------------------------------------------------------------------

    @abstractmethod
    async def upsert_long_term_memory(self, memory: LongTermMemory, *, embedding: Embedding | None = None) -> None:
        """Insert or replace a memory by id; the first ``created_at`` is kept, and an
        upsert without an embedding keeps the stored one."""

    @abstractmethod
    async def delete_long_term_memory(self, user_id: str | None, memory_id: str) -> None:
        """Delete the memory if it belongs to ``user_id``."""

    async def delete_long_term_memories(self, user_id: str | None, *, scope: str | None = None) -> int:
        """Delete every memory of ``user_id`` (only ``scope``'s, if given); return how many.

        Not in AFK's protocol ("forget this user"): every afkmemory backend implements it.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot delete a user's memories at once")

    @abstractmethod
    async def list_long_term_memories(
        self, user_id: str | None, *, scope: str | None = None, limit: int = 100
    ) -> list[LongTermMemory]:
        """Return the user's memories, newest ``updated_at`` first."""

    async def search_long_term_memory_text(
        self, user_id: str | None, query: str, *, scope: str | None = None, limit: int = 20
    ) -> list[LongTermMemory]:
        """Return the user's memories matching every word of ``query``, best first.

        A default, as AFK promises text search on every backend: it lists all the user's
        memories (``list_long_term_memories``) and ranks them as the in-memory store does
        (``text.rank_by_term_count``), reading every one of them per search. Every
        afkmemory backend overrides it (the Django and Redis ones search their indexes).
        """
        check_limit(limit)
        terms = query_terms(query)
        check_user_scope(user_id, scope)
        if not terms:
            return []
        owned = await self.list_long_term_memories(user_id, scope=scope, limit=MAX_INT64)
        return rank_by_term_count(owned, terms, limit)

    async def search_long_term_memory_vector(
        self,
        user_id: str | None,
        query_embedding: Embedding,
        *,
        scope: str | None = None,
        limit: int = 20,
        min_score: float | None = None,
    ) -> list[tuple[LongTermMemory, float]]:
        """Return ``(memory, cosine similarity)`` pairs, most similar first."""
        raise NotImplementedError(f"{type(self).__name__} has no vector search")

    # -- checkpoints and the effect journal (AFK's key layout on top of state) --------------

    async def write_checkpoint(
        self, thread_id: str, run_id: str, step: int, phase: str, payload: JsonValue
    ) -> CheckpointRecord:
        """Write a checkpoint of a run and move the run's latest pointer to it."""
        check_id(thread_id, "thread_id")
        record, entries = checkpoint_entries(thread_id, run_id, step, phase, payload, now_ms())
        await self.put_state_many(thread_id, entries)
        return record

    async def latest_checkpoint(self, thread_id: str, run_id: str) -> CheckpointRecord | None:
        """Return the newest checkpoint of a run, or None if it has none."""
        key = pointer_target(run_id, await self.get_state(thread_id, latest_key(run_id)))
        value = None if key is None else await self.get_state(thread_id, str(key))
        return None if key is None or value is None else checkpoint_from_value(thread_id, key, value)

    async def list_checkpoints(self, thread_id: str, run_id: str) -> list[CheckpointRecord]:
        """Return every checkpoint of a run, in step order (then write time)."""
        check_run_id(run_id)
        return run_checkpoints(thread_id, await self.list_state(thread_id, f"checkpoint:{run_id}:"))

    async def record_effect(
        self,
        thread_id: str,
        run_id: str,
        step: int,
        tool_call_id: str,
        *,
        input_hash: str,
        output: JsonValue,
    ) -> EffectRecord:
        """Journal a completed tool call so a resumed run can replay it."""
        record, key, value = effect_entry(thread_id, run_id, step, tool_call_id, input_hash, output, now_ms())
        await self.put_state(thread_id, key, value)
        return record

    async def get_effect(
        self, thread_id: str, run_id: str, step: int, tool_call_id: str, *, input_hash: str
    ) -> EffectRecord | None:
        """Return the journaled tool call to replay, or None if it never completed.

        Raise ``EffectMismatchError`` if it completed with a different input: replaying
        its result for another input would be wrong.
        """
        key = effect_key(run_id, step, tool_call_id)
        return replayable_effect(thread_id, key, await self.get_state(thread_id, str(key)), input_hash)


def check_limit(limit: Any, name: str = "limit") -> int:
    """Return a non-negative page size, else raise."""
    return check_count(limit, name)
