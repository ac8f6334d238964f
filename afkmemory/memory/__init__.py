"""The memory protocol (AFK's ``MemoryStore``) and its reference backend; no Django needed."""

from .base import MemoryStore
from .compaction import compact_thread, retained
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
    EventType,
    JsonObject,
    JsonValue,
    LongTermMemory,
    MemoryCapabilities,
    MemoryCompactionResult,
    MemoryEvent,
    RetentionPolicy,
    new_id,
    now_ms,
)

__all__ = [
    "EVENT_TYPES",
    "CheckpointRecord",
    "EffectMismatchError",
    "EffectRecord",
    "EventType",
    "InMemoryMemoryStore",
    "JsonObject",
    "JsonValue",
    "LongTermMemory",
    "MemoryCapabilities",
    "MemoryCompactionResult",
    "MemoryEvent",
    "MemoryStore",
    "RetentionPolicy",
    "compact_thread",
    "hash_tool_input",
    "new_id",
    "now_ms",
    "parse_state_key",
    "retained",
]
