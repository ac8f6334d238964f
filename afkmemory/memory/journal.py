"""AFK's state-key layout for run checkpoints and the effect journal of completed tool calls.

Keys, exactly as AFK's runner and compaction read them:

- ``checkpoint:<run>:<step>:<phase>`` holds one checkpoint (phase e.g. ``pre_llm``,
  ``post_tool_batch``, ``step_end``);
- ``checkpoint:<run>:latest`` points at the newest checkpoint of the run;
- ``effect:<run>:<step>:<tool_call_id>`` records one completed tool call with the hash of
  its input, so a resumed run replays the result instead of running the tool again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .types import MAX_ID_BYTES, MAX_INT64, JsonValue, check_count, check_id, check_json


class EffectMismatchError(ValueError):
    """A recorded tool call was replayed with a different input than it ran with."""


@dataclass(frozen=True, slots=True)
class CheckpointKey:
    """The parts of a ``checkpoint:<run>:<step>:<phase>`` key."""

    PREFIX: ClassVar[str] = "checkpoint:"
    run_id: str
    step: int
    phase: str

    def __str__(self) -> str:
        return f"{self.PREFIX}{self.run_id}:{self.step}:{self.phase}"


@dataclass(frozen=True, slots=True)
class EffectKey:
    """The parts of an ``effect:<run>:<step>:<tool_call_id>`` key."""

    PREFIX: ClassVar[str] = "effect:"
    run_id: str
    step: int
    tool_call_id: str

    def __str__(self) -> str:
        return f"{self.PREFIX}{self.run_id}:{self.step}:{self.tool_call_id}"


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """One checkpoint of a run as stored under its key."""

    thread_id: str
    run_id: str
    step: int
    phase: str
    timestamp_ms: int
    payload: JsonValue

    @property
    def key(self) -> str:
        return str(CheckpointKey(self.run_id, self.step, self.phase))


@dataclass(frozen=True, slots=True)
class EffectRecord:
    """One completed tool call of a run."""

    thread_id: str
    run_id: str
    step: int
    tool_call_id: str
    input_hash: str
    output: JsonValue
    timestamp_ms: int


#: The end of a run's latest-checkpoint pointer's key: ``checkpoint:<run>:latest``.
LATEST_SUFFIX = ":latest"


def latest_key(run_id: str) -> str:
    """Return the key of the pointer to a run's newest checkpoint."""
    return f"{CheckpointKey.PREFIX}{check_run_id(run_id)}{LATEST_SUFFIX}"


def latest_run(key: str) -> str | None:
    """Return the run whose latest pointer ``key`` is, or None for any other key."""
    parts = key.split(":")
    return parts[1] if len(parts) == 3 and parts[0] == "checkpoint" and parts[2] == "latest" and parts[1] else None


def check_run_id(run_id: Any) -> str:
    """Return ``run_id`` if it can stand in a key (no ``:``, which AFK splits on)."""
    check_id(run_id, "run_id")
    if ":" in run_id:
        raise ValueError("run_id must not contain ':' (AFK's state keys are ':'-separated)")
    return run_id


def _canonical_step(text: str) -> int | None:
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(MAX_INT64)):
        return None
    step = int(text)
    return step if str(step) == text and step <= MAX_INT64 else None


def _fits(part: str) -> bool:
    """Whether a key's run id or phase fits its column (``MAX_ID_BYTES``; a tool call id's
    column holds any the key's ``MAX_KEY_BYTES`` can)."""
    return len(part.encode("utf-8")) <= MAX_ID_BYTES


def parse_state_key(key: str) -> CheckpointKey | EffectKey | None:
    """Return the checkpoint or effect a state key names, or None for a plain key.

    Only keys that round-trip exactly are recognised, so ``str(parse_state_key(k)) == k``,
    and whose parts fit their columns (a run id and phase of ``MAX_ID_BYTES``, a 64-bit
    step): any other key is a plain one, on every backend.
    """
    parts = key.split(":", 3)
    if len(parts) != 4 or parts[0] not in ("checkpoint", "effect"):
        return None
    kind, run_id, step_text, last = parts
    step = _canonical_step(step_text)
    if not run_id or step is None or not last or not _fits(run_id):
        return None
    if kind == "checkpoint":
        return CheckpointKey(run_id, step, last) if _fits(last) else None
    return EffectKey(run_id, step, last)


def hash_tool_input(tool_input: JsonValue) -> str:
    """Return the hash a tool call's input is journaled under (SHA-256 of canonical JSON)."""
    check_json(tool_input, "tool_input")
    canonical = json.dumps(tool_input, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def checkpoint_entries(
    thread_id: str, run_id: str, step: int, phase: str, payload: JsonValue, timestamp_ms: int
) -> tuple[CheckpointRecord, dict[str, JsonValue]]:
    """Return the record and the two state entries (checkpoint and latest pointer) to write."""
    check_run_id(run_id)
    check_count(step, "step")
    check_id(phase, "phase")
    check_json(payload, "payload")
    record = CheckpointRecord(thread_id, run_id, step, phase, timestamp_ms, payload)
    value: JsonValue = {
        "run_id": run_id,
        "step": step,
        "phase": phase,
        "timestamp_ms": timestamp_ms,
        "payload": payload,
    }
    pointer: JsonValue = {
        "run_id": run_id,
        "step": step,
        "phase": phase,
        "timestamp_ms": timestamp_ms,
        "key": record.key,
    }
    return record, {record.key: value, latest_key(run_id): pointer}


def pointer_target(run_id: str, pointer: JsonValue) -> CheckpointKey | None:
    """Return the checkpoint a run's latest pointer names, or None if it names none of the run's."""
    target = pointer.get("key") if isinstance(pointer, dict) else None
    key = parse_state_key(target) if isinstance(target, str) else None
    return key if isinstance(key, CheckpointKey) and key.run_id == run_id else None


def run_checkpoints(thread_id: str, state: Mapping[str, JsonValue]) -> list[CheckpointRecord]:
    """Return the checkpoints among ``state``'s entries in step order (then write time, phase)."""
    records = [
        checkpoint_from_value(thread_id, key, value)
        for text, value in state.items()
        if isinstance(key := parse_state_key(text), CheckpointKey)
    ]
    return sorted(records, key=lambda r: (r.step, r.timestamp_ms, r.phase))


def checkpoint_from_value(thread_id: str, key: CheckpointKey, value: JsonValue) -> CheckpointRecord:
    """Return the record stored under a checkpoint key (a foreign value becomes the payload)."""
    if isinstance(value, dict) and "payload" in value:
        ts = value.get("timestamp_ms")
        return CheckpointRecord(
            thread_id, key.run_id, key.step, key.phase, ts if isinstance(ts, int) else 0, value["payload"]
        )
    return CheckpointRecord(thread_id, key.run_id, key.step, key.phase, 0, value)


def effect_value(run_id: str, step: int, tool_call_id: str, input_hash: str, output: JsonValue, ts: int) -> JsonValue:
    """Return the state value an effect is journaled as."""
    return {
        "run_id": run_id,
        "step": step,
        "tool_call_id": tool_call_id,
        "input_hash": input_hash,
        "output": output,
        "timestamp_ms": ts,
    }


def effect_from_value(thread_id: str, key: EffectKey, value: JsonValue) -> EffectRecord:
    """Return the effect record stored under an effect key."""
    data = value if isinstance(value, dict) else {}
    input_hash = data.get("input_hash")
    ts = data.get("timestamp_ms")
    return EffectRecord(
        thread_id,
        key.run_id,
        key.step,
        key.tool_call_id,
        input_hash if isinstance(input_hash, str) else "",
        data.get("output"),
        ts if isinstance(ts, int) else 0,
    )


def effect_key(run_id: str, step: int, tool_call_id: str) -> EffectKey:
    """Return the key a tool call's effect is journaled under; raise if a part is not usable."""
    check_run_id(run_id)
    check_count(step, "step")
    check_id(tool_call_id, "tool_call_id")
    return EffectKey(run_id, step, tool_call_id)


def effect_entry(
    thread_id: str, run_id: str, step: int, tool_call_id: str, input_hash: str, output: JsonValue, ts: int
) -> tuple[EffectRecord, str, JsonValue]:
    """Return a completed tool call's record, and the state key and value that journal it (``record_effect``)."""
    check_id(thread_id, "thread_id")
    key = effect_key(run_id, step, tool_call_id)
    check_id(input_hash, "input_hash")
    value = effect_value(run_id, step, tool_call_id, input_hash, output, ts)
    return EffectRecord(thread_id, run_id, step, tool_call_id, input_hash, output, ts), str(key), value


def replayable_effect(thread_id: str, key: EffectKey, value: JsonValue | None, input_hash: str) -> EffectRecord | None:
    """Return the effect journaled as ``value`` to replay, or None if there is none (``get_effect``).

    Raise ``EffectMismatchError`` if it completed with a different input: replaying its
    result for another input would be wrong.
    """
    check_id(input_hash, "input_hash")
    if value is None:
        return None
    record = effect_from_value(thread_id, key, value)
    if record.input_hash != input_hash:
        raise EffectMismatchError(
            f"tool call {key.tool_call_id!r} of run {key.run_id!r} step {key.step} ran with input "
            f"{record.input_hash or '(unknown)'}, not {input_hash}; refusing to replay it"
        )
    return record
