"""ORM-backed stores: AFK's MemoryStore, agentflow's Store and Checkpointer.

Each store comes as a sync class holding all the logic (``Sync...``; views and
tasks call it directly) and an async class implementing the published
protocol, whose every method is a ``sync_to_async`` hop into the sync class, shared
with the concurrent calls bound for the same thread (see ``concurrency``; on PostgreSQL,
with ``ASYNC_POOL``, the hot calls run on connections of their own instead: see
``asyncpool``).
"""

from __future__ import annotations

from .asyncpool import close_async_pools
from .checkpoints import CheckpointRetention, DjangoCheckpointer, SyncDjangoCheckpointer
from .concurrency import own_thread
from .items import DjangoStore, SyncDjangoStore, TTLOverflowError
from .memory import DjangoMemoryStore, SyncDjangoMemoryStore

__all__ = [
    "CheckpointRetention",
    "close_async_pools",
    "DjangoCheckpointer",
    "DjangoMemoryStore",
    "DjangoStore",
    "SyncDjangoCheckpointer",
    "SyncDjangoMemoryStore",
    "SyncDjangoStore",
    "TTLOverflowError",
    "own_thread",
]
