"""Retention of thread events: which events a compaction keeps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from .types import MemoryCompactionResult, RetentionPolicy, check_id

if TYPE_CHECKING:
    from .base import MemoryStore

T = TypeVar("T")


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


async def compact_thread(
    store: MemoryStore, *, thread_id: str, event_policy: RetentionPolicy | None = None
) -> MemoryCompactionResult:
    """Compact one thread of ``store`` with ``event_policy`` (AFK's defaults if None).

    The newest ``scan_limit`` events are judged by the policy; events older than that
    window are removed, as AFK does. Events appended while the compaction runs are
    never removed by it.
    """
    check_id(thread_id, "thread_id")
    policy = event_policy if event_policy is not None else RetentionPolicy()
    if not isinstance(policy, RetentionPolicy):
        raise TypeError(f"event_policy must be a RetentionPolicy, got {type(policy).__name__}")
    return await store.compact_thread(thread_id, policy)
