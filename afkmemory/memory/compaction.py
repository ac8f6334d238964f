"""Retention: which events, checkpoints and effects of a thread a compaction keeps."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .journal import CheckpointKey, EffectKey, latest_key, latest_run, parse_state_key
from .types import JsonValue, MemoryCompactionResult, RetentionPolicy, StateRetentionPolicy, check_id

if TYPE_CHECKING:
    from .base import MemoryStore

T = TypeVar("T")
P = TypeVar("P")

#: The phase of a run's last checkpoint: a kept run keeps it, whatever ``always_keep_phases`` says.
TERMINAL_PHASE = "run_terminal"


def retained(window: Sequence[tuple[T, str]], policy: RetentionPolicy) -> set[T]:
    """Return the ids to keep out of ``window``: ``(id, type)`` pairs, oldest first.

    Events of ``policy.keep_event_types`` are kept first (the newest of them, if there
    are more than the budget), then the newest other events fill what is left of
    ``max_events_per_thread``.
    """
    budget = policy.max_events_per_thread
    protected_types = set(policy.keep_event_types)
    protected = [ident for ident, kind in window if kind in protected_types]
    others = [ident for ident, kind in window if kind not in protected_types]
    kept_protected = protected[max(len(protected) - budget, 0) :]
    room = budget - len(kept_protected)
    kept_others = others[max(len(others) - room, 0) :] if room > 0 else []
    return {*kept_protected, *kept_others}


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def retained_state(state: Mapping[str, JsonValue], policy: StateRetentionPolicy) -> set[str]:
    """Return the state keys to keep under ``policy`` (see ``StateRetentionPolicy``)."""
    latest: list[tuple[int, str, Mapping[str, JsonValue]]] = []
    checkpoints: dict[str, list[tuple[CheckpointKey, str]]] = defaultdict(list)
    effects: dict[str, list[tuple[EffectKey, str]]] = defaultdict(list)
    keep: set[str] = set()
    for key, value in state.items():
        parsed = parse_state_key(key)
        run = latest_run(key)
        if run is not None:
            pointer: Mapping[str, JsonValue] = value if isinstance(value, dict) else {}
            latest.append((_int(pointer.get("timestamp_ms")) or 0, run, pointer))
        elif isinstance(parsed, CheckpointKey):
            checkpoints[parsed.run_id].append((parsed, key))
        elif isinstance(parsed, EffectKey):
            effects[parsed.run_id].append((parsed, key))
        else:
            keep.add(key)
    keep.update(k for k in state if any(k.startswith(p) for p in policy.keep_state_prefixes))

    latest.sort(key=lambda row: (-row[0], row[1]))
    always = set(policy.always_keep_phases)
    max_runs, max_runtime_states, max_effects = kept_limits(policy)
    for _, run, pointer in latest[:max_runs]:
        keep.add(latest_key(run))
        latest_step = _int(pointer.get("step"))
        runtime = sorted((c for c in checkpoints[run] if c[0].phase == "runtime_state"), key=lambda c: -c[0].step)
        keep.update(key for _, key in runtime[:max_runtime_states])
        keep.update(
            key
            for parsed, key in checkpoints[run]
            if parsed.phase in always or parsed.phase == TERMINAL_PHASE or parsed.step == latest_step
        )
        newest_effects = sorted(effects[run], key=lambda e: (-e[0].step, e[1]))
        keep.update(key for _, key in newest_effects[:max_effects])
    return keep


def kept_limits(policy: StateRetentionPolicy) -> tuple[int, int, int]:
    """The runs, runtime states per run and effects per run ``policy`` keeps.

    Each at least one, as AFK's ``apply_state_retention``: the newest run stays resumable.
    """
    return max(policy.max_runs, 1), max(policy.max_runtime_states_per_run, 1), max(policy.max_effect_entries_per_run, 1)


def check_policy(policy: Any, kind: type[P], name: str) -> P:
    """Return ``policy`` if it is a ``kind`` (a dict of its fields is not), else raise ``TypeError``."""
    if not isinstance(policy, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, got {type(policy).__name__}")
    return policy


def doomed_state(state: Mapping[str, JsonValue], policy: StateRetentionPolicy) -> list[str]:
    """The keys of ``state`` that ``policy`` drops (every backend's ``compact_state`` decides here)."""
    check_policy(policy, StateRetentionPolicy, "state_policy")
    keep = retained_state(state, policy)
    return [key for key in state if key not in keep]


async def compact_thread(
    store: MemoryStore,
    *,
    thread_id: str,
    event_policy: RetentionPolicy | None = None,
    state_policy: StateRetentionPolicy | None = None,
) -> MemoryCompactionResult:
    """Compact one thread of ``store`` with ``event_policy`` (AFK's defaults if None).

    The newest ``scan_limit`` events are judged by the policy; events older than that
    window are removed, as AFK does. Events appended while the compaction runs are
    never removed by it on afkmemory's backends (``MemoryStore.compact_thread``'s default,
    which a custom backend may inherit, can lose them). With a ``state_policy``, the
    checkpoints and effects of old runs are pruned too (checkpoint tables must not grow
    forever, ``store.compact_state``); keys written meanwhile, new or rewritten, are
    never removed.
    """
    check_id(thread_id, "thread_id")
    policy = check_policy(
        event_policy if event_policy is not None else RetentionPolicy(), RetentionPolicy, "event_policy"
    )
    if state_policy is not None:
        check_policy(state_policy, StateRetentionPolicy, "state_policy")
    result = await store.compact_thread(thread_id, policy)
    if state_policy is None:
        return result
    before, removed = await store.compact_state(thread_id, state_policy)
    return dataclasses.replace(
        result, state_keys_before=before, state_keys_after=before - removed, state_keys_removed=removed
    )
