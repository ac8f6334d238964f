"""Records of the memory protocol and the validation every backend applies to them."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, get_args

import numpy as np
from numpy.typing import NDArray

JsonValue = None | bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"]
JsonObject = dict[str, JsonValue]
EventType = Literal["tool_call", "tool_result", "message", "system", "trace"]
EVENT_TYPES: frozenset[str] = frozenset(get_args(EventType))

#: Longest identifier (thread, event, memory, run, state key ...) in UTF-8 bytes.
#: PostgreSQL btree entries are limited to about 2.7 kB (LangGraph #6239 overflowed
#: it with a long thread id), so every indexed string has a bound and says so.
MAX_ID_BYTES = 255
FLOAT32_MAX = 3.4028234663852886e38
MAX_KEY_BYTES = 1024
#: The largest integer a column holds (SQL's bigint; SQLite's INTEGER): timestamps, steps.
MAX_INT64 = 2**63 - 1
MIN_INT64 = -(2**63)
#: Deepest nesting of lists and objects a JSON value may have (the REST API's bodies have the same limit):
#: deeper values crash recursive code (Python's, the JSON encoders', copy.deepcopy).
MAX_JSON_DEPTH = 100


def now_ms() -> int:
    """Return the current time in milliseconds since the epoch."""
    return time.time_ns() // 1_000_000


def new_id(prefix: str = "id") -> str:
    """Return a new random identifier such as ``evt_3f2a...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class DuplicateEventError(ValueError):
    """An event's id is already in its thread: nothing was appended."""

    def __init__(self, event_id: str, thread_id: str) -> None:
        super().__init__(f"event {event_id!r} already exists in thread {thread_id!r}")
        self.event_id = event_id
        self.thread_id = thread_id


@dataclass(slots=True)
class MemoryEvent:
    """One event of a conversation thread: a message, a tool call or result, a trace."""

    id: str
    thread_id: str
    user_id: str | None
    type: EventType
    timestamp: int
    payload: JsonObject = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)


@dataclass(slots=True)
class LongTermMemory:
    """A durable piece of knowledge about a user, optionally searchable by embedding."""

    id: str
    user_id: str | None
    scope: str = "global"
    data: JsonObject = field(default_factory=dict)
    text: str | None = None
    tags: list[str] = field(default_factory=list)
    metadata: JsonObject = field(default_factory=dict)
    created_at: int = field(default_factory=now_ms)
    updated_at: int = field(default_factory=now_ms)


@dataclass(frozen=True, slots=True)
class MemoryCapabilities:
    """What a backend supports, so callers only use features that exist."""

    text_search: bool = False
    vector_search: bool = False
    atomic_upsert: bool = False
    ttl: bool = False


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """How compaction trims a thread: protected types first, then the newest events."""

    max_events_per_thread: int = 5000
    keep_event_types: list[str] = field(default_factory=lambda: ["trace"])
    scan_limit: int = 20_000

    def __post_init__(self) -> None:
        check_count(self.max_events_per_thread, "max_events_per_thread")
        check_count(self.scan_limit, "scan_limit", minimum=1)
        if isinstance(self.keep_event_types, str) or not all(isinstance(t, str) for t in self.keep_event_types):
            raise TypeError("keep_event_types must be a list of event type names")
        unknown = set(self.keep_event_types) - EVENT_TYPES
        if unknown:
            raise ValueError(
                f"keep_event_types has unknown event types {sorted(unknown)}; known types are {sorted(EVENT_TYPES)}"
            )


@dataclass(frozen=True, slots=True)
class StateRetentionPolicy:
    """Which checkpoints and effects of old runs a compaction drops (AFK's defaults).

    The ``max_runs`` runs with the newest ``checkpoint:<run>:latest`` pointers are kept;
    the checkpoints and effects of every other run go. Within a kept run, checkpoints in
    ``always_keep_phases``, of the latest step or ``run_terminal`` stay, as do the newest
    ``max_runtime_states_per_run`` ``runtime_state`` checkpoints and the newest
    ``max_effect_entries_per_run`` effects. Keys that are neither checkpoints nor effects,
    and keys under ``keep_state_prefixes``, are always kept.
    """

    max_runs: int = 100
    max_runtime_states_per_run: int = 3
    max_effect_entries_per_run: int = 3000
    always_keep_phases: list[str] = field(
        default_factory=lambda: [
            "run_terminal",
            "runtime_state",
            "pre_tool_batch",
            "post_tool_batch",
            "pre_llm",
            "post_llm",
            "run_started",
            "paused",
            "resumed",
        ]  # fmt: skip
    )
    keep_state_prefixes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_count(self.max_runs, "max_runs")
        check_count(self.max_runtime_states_per_run, "max_runtime_states_per_run")
        check_count(self.max_effect_entries_per_run, "max_effect_entries_per_run")
        for name in ("always_keep_phases", "keep_state_prefixes"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise TypeError(f"{name} must be a list of strings")


@dataclass(frozen=True, slots=True)
class MemoryCompactionResult:
    """What a compaction did to one thread (state counts stay 0 without a state policy)."""

    events_before: int
    events_after: int
    events_removed: int
    state_keys_before: int = 0
    state_keys_after: int = 0
    state_keys_removed: int = 0


# -- validation ---------------------------------------------------------------------------------


def check_count(value: Any, name: str, *, minimum: int = 0, maximum: int = MAX_INT64) -> int:
    """Return ``value`` if it is an int from ``minimum`` to ``maximum`` (``MAX_INT64``), else raise a clear error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        limit = "2**63 - 1 (a 64-bit integer)" if maximum == MAX_INT64 else maximum
        raise ValueError(f"{name} must be at most {limit}, got {value}")
    return value


def check_text(value: str, name: str) -> None:
    """Raise ``ValueError`` unless every database can store ``value``: no NUL, no lone surrogate."""
    if "\x00" in value:
        raise ValueError(f"{name} must not contain NUL characters ('\\x00'); PostgreSQL text cannot store them")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode text (lone surrogate at index {exc.start})") from None


def check_prefix(value: Any, name: str = "prefix") -> str | None:
    """Return ``value`` if it is None or a string every database can compare (``check_text``), else raise."""
    if value is not None:
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a string or None, got {type(value).__name__}")
        check_text(value, name)
    return value


def check_id(value: Any, name: str, *, max_bytes: int = MAX_ID_BYTES, optional: bool = False) -> Any:
    """Return ``value`` if it is a usable identifier string, else raise a clear error."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must not be empty")
    check_text(value, name)
    size = len(value.encode("utf-8"))
    if size > max_bytes:
        raise ValueError(f"{name} is {size} bytes in UTF-8; the limit is {max_bytes}")
    return value


def check_path_id(value: Any, name: str) -> str:
    """Return ``value`` if it is an id that can be a URL's path segment (``threads/{thread_id}/``), else raise.

    No ``/``, and not ``.`` or ``..``, which HTTP clients resolve away before sending.
    """
    check_id(value, name)
    if "/" in value:
        raise ValueError(f"{name} must not contain '/', so that the API's URLs can name it")
    if value in (".", ".."):
        raise ValueError(f"{name} must not be {value!r}: HTTP clients resolve it away in the API's URLs")
    return value


def check_memory_id(value: Any, name: str) -> str:
    """Return ``value`` if the API's ``memories/{id}/`` can name it: a path id, not ``search`` (the search's URL)."""
    if value == "search":
        raise ValueError(f"{name} must not be 'search': memories/search/ is the search endpoint")
    return check_path_id(value, name)


def check_json(value: Any, name: str) -> Any:
    """Return ``value`` if it is JSON every database stores (str keys, finite numbers, text as ``check_text``)."""
    _walk_json(value, name)
    return value


def json_round_trip(value: Any, name: str) -> tuple[Any, str]:
    """Return ``value`` as JSON hands it back (tuples become lists), and its JSON text; raise as ``check_json`` does.

    One round trip through ``dumps`` in C; the Python walk that names the offending part
    runs only when the round trip fails or does not give ``value`` back (a non-string
    key, a NUL, or merely a tuple).
    """
    try:
        text = dumps(value)
        text.encode("utf-8")  # a lone surrogate: SQLite would keep it, PostgreSQL's json refuses it
    except (TypeError, ValueError, RecursionError):
        _walk_json(value, name)  # names the problem (nesting past MAX_JSON_DEPTH, for a RecursionError)
        raise
    copy = json.loads(text)
    if "\\u0000" in text or copy != value:
        _walk_json(value, name)
    return copy, text


def _walk_json(value: Any, path: str, depth: int = 0) -> None:
    if value is None or isinstance(value, (bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path} is {value!r}; JSON has no NaN or infinity")
        return
    if isinstance(value, str):
        # PostgreSQL's jsonb cannot hold \u0000 or a lone surrogate; refuse them everywhere so backends agree.
        check_text(value, path)
        return
    if isinstance(value, (list, tuple, dict)) and depth >= MAX_JSON_DEPTH:
        raise ValueError(f"{path.partition('[')[0]} is nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _walk_json(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{path} has a non-string key {key!r}; JSON object keys are strings")
            _walk_json(key, f"{path} key", depth + 1)
            _walk_json(item, f"{path}[{key!r}]", depth + 1)
        return
    raise TypeError(f"{path} is a {type(value).__name__}, which is not JSON-serializable")


def check_tags(value: Any, name: str = "tags") -> list[str]:
    """Return ``value`` as a list of strings, else raise."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of strings, got {type(value).__name__}")
    for tag in value:
        if not isinstance(tag, str):
            raise TypeError(f"{name} must contain only strings, got {type(tag).__name__}")
    check_json(list(value), name)
    return list(value)


def check_state_key(key: Any, name: str = "key") -> str:
    """Return ``key`` if it is a valid state key (an id of at most ``MAX_KEY_BYTES``), else raise."""
    return check_id(key, name, max_bytes=MAX_KEY_BYTES)


def check_state_entries(entries: Any) -> dict[str, JsonValue]:
    """Return ``entries`` if it is a dict of valid state keys to JSON values, else raise."""
    if not isinstance(entries, dict):
        raise TypeError(f"entries must be a dict of key to value, got {type(entries).__name__}")
    for key, value in entries.items():
        check_state_key(key)
        check_json(value, f"value of {key!r}")
    return entries


def check_state_keys(keys: Any) -> list[str]:
    """Return ``keys`` as a list of valid state keys, else raise (one string is not a list of keys)."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise TypeError(f"keys must be a sequence of state keys, got {type(keys).__name__}")
    keys = list(keys)
    for key in keys:
        check_state_key(key)
    return keys


def check_object(value: Any, name: str) -> JsonObject:
    """Return ``value`` if it is a JSON object (a dict), else raise."""
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a JSON object (dict), got {type(value).__name__}")
    return check_json(value, name)


def check_timestamp(value: Any, name: str) -> int:
    """Return ``value`` if it is a millisecond timestamp, else raise."""
    return check_count(value, name)


def check_user_scope(user_id: Any, scope: Any) -> None:
    """Raise unless ``user_id`` and ``scope`` are ids or None: whose memories a call reads."""
    check_id(user_id, "user_id", optional=True)
    check_id(scope, "scope", optional=True)


def check_replacement(thread_id: Any, events: Any) -> list[MemoryEvent]:
    """Return ``events`` (read once, as a list) if they can replace thread ``thread_id``'s, else raise.

    Each must be valid and of that thread, and no id may be given twice. Read once: a
    generator validated, then written, would write nothing.
    """
    check_id(thread_id, "thread_id")
    events = list(events)
    for event in events:
        validate_event(event)
        if event.thread_id != thread_id:
            raise ValueError(f"event {event.id!r} belongs to thread {event.thread_id!r}, not {thread_id!r}")
    if len({e.id for e in events}) != len(events):
        raise ValueError("replace_thread_events got duplicate event ids")
    return events


def validate_event(event: Any) -> MemoryEvent:
    """Return ``event`` if every field is valid, else raise ``TypeError``/``ValueError``."""
    if not isinstance(event, MemoryEvent):
        raise TypeError(f"expected a MemoryEvent, got {type(event).__name__}")
    check_id(event.id, "event.id")
    check_id(event.thread_id, "event.thread_id")
    check_id(event.user_id, "event.user_id", optional=True)
    if not isinstance(event.type, str):
        raise TypeError(f"event.type must be a string, one of {sorted(EVENT_TYPES)}; got {type(event.type).__name__}")
    if event.type not in EVENT_TYPES:
        raise ValueError(f"event.type {event.type!r} is not one of {sorted(EVENT_TYPES)}")
    check_timestamp(event.timestamp, "event.timestamp")
    check_object(event.payload, "event.payload")
    check_tags(event.tags, "event.tags")
    return event


def check_optional_id(value: Any, name: str) -> Any:
    """``check_id`` of a field that may be None."""
    return check_id(value, name, optional=True)


def check_optional_text(value: Any, name: str) -> str | None:
    """Return ``value`` if it is None or text every database stores, else raise."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string or None, got {type(value).__name__}")
    return check_json(value, name)


#: Each stored field of a ``LongTermMemory`` and its check (``validate_memory``; the admin's
#: memory form runs the same ones), the embedding aside: its length is the store's setting.
MEMORY_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "id": check_id,
    "user_id": check_optional_id,
    "scope": check_id,
    "data": check_object,
    "text": check_optional_text,
    "tags": check_tags,
    "metadata": check_object,
    "created_at": check_timestamp,
    "updated_at": check_timestamp,
}


def validate_memory(memory: Any) -> LongTermMemory:
    """Return ``memory`` if every field is valid, else raise ``TypeError``/``ValueError``."""
    if not isinstance(memory, LongTermMemory):
        raise TypeError(f"expected a LongTermMemory, got {type(memory).__name__}")
    for name, check in MEMORY_CHECKS.items():
        check(getattr(memory, name), f"memory.{name}")
    return memory


#: An embedding: a sequence of numbers, or a numpy array of floats (what embedding models return).
Embedding: TypeAlias = Sequence[float] | NDArray[np.floating[Any]]


def check_embedding(value: Any, name: str, dimensions: int | None, setting: str = "") -> list[float]:
    """Return ``value`` as a list of floats of length ``dimensions`` (None: any), else raise.

    ``setting`` names where the length is configured, for the error.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) and not hasattr(value, "tolist"):
        raise TypeError(f"{name} must be a sequence of numbers, got {type(value).__name__}")
    items = value.tolist() if hasattr(value, "tolist") else list(value)
    if dimensions is not None and len(items) != dimensions:
        where = f" ({setting})" if setting else ""
        raise ValueError(f"{name} has {len(items)} dimensions; this store is configured for {dimensions}{where}")
    if not items:
        raise ValueError(f"{name} must not be empty")
    # The common case, plain floats, checked in C loops: a Python loop over each number cost
    # 0.15 ms for 384 of them, a tenth of a vector search. A sum is finite only if every
    # number is. Anything else takes the loop below, which names the offending value.
    finite = set(map(type, items)) == {float} and math.isfinite(sum(items))
    if finite and any(items) and max(map(abs, items)) <= FLOAT32_MAX:
        return _check_float32_length(items, name)
    floats: list[float] = []
    for x in items:
        # numpy's numbers too, as the Python numbers they stand for: ``list(model.encode(text))``
        # holds np.float32, which is no float subclass (np.float64 is). np.bool_ is neither
        # np.floating nor np.integer: refused, as bool is.
        if isinstance(x, np.floating):
            x = float(x)
        elif isinstance(x, np.integer):
            x = int(x)
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise TypeError(f"{name} must contain only numbers, got {type(x).__name__}")
        if isinstance(x, float) and not math.isfinite(x):
            raise ValueError(f"{name} contains {x!r}; embeddings must be finite")
        if abs(x) > FLOAT32_MAX:  # stored as float32, as pgvector does (an int past any float too)
            raise ValueError(f"{name} contains {x!r}, beyond float32's range (±{FLOAT32_MAX:.7g})")
        floats.append(float(x))
    if not any(floats):
        raise ValueError(f"{name} is all zeros; cosine similarity is undefined for it")
    return _check_float32_length(floats, name)


def _check_float32_length(values: list[float], name: str) -> list[float]:
    """Return ``values`` if their squared length is a positive float32, as pgvector computes it; else raise.

    Vectors are stored as float32, and pgvector sums the squares in float32: numbers too
    small for it become a zero vector (a NaN similarity), large ones overflow the sum (a
    similarity of 0, whatever the angle).
    """
    vector = np.asarray(values, dtype=np.float32)
    with np.errstate(over="ignore", under="ignore"):
        square = float(np.dot(vector, vector))
    if square == 0.0:
        raise ValueError(f"{name} is too close to zero: stored as float32 it has no length, and no cosine similarity")
    if not math.isfinite(square):
        raise ValueError(f"{name} is too long: its squared length overflows float32, in which similarity is computed")
    return values


def cosine_similarities(matrix: NDArray[np.float64], query: NDArray[np.float64]) -> NDArray[np.float64]:
    """Each row of ``matrix``'s cosine similarity to ``query``, as pgvector computes it.

    The dot product and the two squared lengths summed alike, then one square root of the
    lengths' product, clipped to [-1, 1]: a memory's own vector scores exactly 1.0 (the
    product of two norms rounds: 1 +- 2e-16, and ``min_score=1.0`` missed a duplicate), and
    none scores past 1. Row by row (``einsum``), not ``matrix @ query``: BLAS's sum for a
    row depends on how many rows the matrix has, so one memory scored a last bit apart on a
    full page and on a short one. A zero row gives NaN.
    """
    rows, row = np.einsum("ij,j->i", matrix, query), query[np.newaxis]  # the query as a row, summed as the rows are
    lengths = np.einsum("ij,ij->i", matrix, matrix) * np.einsum("ij,ij->i", row, row)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.clip(rows / np.sqrt(lengths), -1.0, 1.0)


def check_min_score(value: Any) -> float | None:
    """Return ``value`` if it is None or a finite number, else raise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"min_score must be a finite number or None, got {value!r}")
    return float(value)


def dumps(value: JsonValue) -> str:
    """Serialize ``value`` to compact JSON, the one encoding every backend stores."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
