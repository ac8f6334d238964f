"""The memory protocol (AFK's ``MemoryStore``) and its reference backend; no Django needed."""

from .base import MemoryStore
from .compaction import compact_thread, retained, retained_state
from .factory import MemoryBackendError, create_memory_store
from .inmemory import InMemoryMemoryStore
from .journal import (
    CheckpointRecord,
    EffectMismatchError,
    EffectRecord,
    hash_tool_input,
    parse_state_key,
)
from .types import (
    EVENT_TYPES,
    DuplicateEventError,
    Embedding,
    EventType,
    JsonObject,
    JsonValue,
    LongTermMemory,
    MemoryCapabilities,
    MemoryCompactionResult,
    MemoryEvent,
    RetentionPolicy,
    StateRetentionPolicy,
    new_id,
    now_ms,
)

__all__ = [
    "EVENT_TYPES",
    "CheckpointRecord",
    "DuplicateEventError",
    "EffectMismatchError",
    "EffectRecord",
    "EventType",
    "InMemoryMemoryStore",
    "JsonObject",
    "JsonValue",
    "Embedding",
    "LongTermMemory",
    "MemoryCapabilities",
    "MemoryBackendError",
    "MemoryCompactionResult",
    "MemoryEvent",
    "MemoryStore",
    "RetentionPolicy",
    "StateRetentionPolicy",
    "compact_thread",
    "create_memory_store",
    "hash_tool_input",
    "new_id",
    "now_ms",
    "parse_state_key",
    "retained",
    "retained_state",
]
