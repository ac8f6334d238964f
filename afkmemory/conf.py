"""afkmemory's settings: ``settings.AFKMEMORY`` over documented defaults.

Example::

    AFKMEMORY = {
        "EMBEDDING_DIMENSIONS": 1536,      # length of every stored and query embedding
        "TEXT_SEARCH_CONFIG": "english",   # PostgreSQL text search configuration
        "HNSW_M": 16,                      # HNSW graph degree (index build)
        "HNSW_EF_CONSTRUCTION": 64,        # HNSW build-time candidate list
        "HNSW_EF_SEARCH": 100,             # query-time candidate list (raised to the limit)
        "HNSW_MAX_SCAN_TUPLES": 20000,     # pgvector 0.8 iterative scan bound
        "EXACT_SEARCH_THRESHOLD": 500,     # at most this many candidates: exact scan (more if too selective for HNSW)
        "HNSW_TUPLE_COST": 16,             # an HNSW index tuple in exact rankings: exact up to sqrt(16 x limit x rows)
        "DELETE_BATCH_SIZE": 500,          # rows per DELETE in compaction and sweeps
        "COMPACTION_POLICY": {             # what the scheduled compaction keeps (RetentionPolicy)
            "max_events_per_thread": 5000, "keep_event_types": ["trace"], "scan_limit": 20000,
        },
        "STATE_RETENTION_POLICY": {},      # the checkpoints and effects it keeps (StateRetentionPolicy; None: all)
        "GRAPH_CHECKPOINT_RETENTION": {},  # the graph checkpoints it keeps (CheckpointRetention; None: all)
        "JOB_LEASE_SECONDS": 3600,         # a scheduled job's claim outlives a crashed worker by this
        "DATABASE_ALIAS": "default",       # the database the REST API reads and writes (its accounts too)
        "ASYNC_POOL": False,               # async stores' hot calls on PostgreSQL: own connections, no hop
        "ASYNC_POOL_SIZE": 10,             # at most this many of them per event loop and database
        "ASYNC_POOL_PREPARE": True,        # their statements as server-side prepared statements
        "API_MAX_PAGE_SIZE": 500,          # largest limit / page_size the REST API accepts
        "API_MAX_VALUE_BYTES": 1048576,    # largest JSON value (state, item, payload ...) it stores
        "API_MAX_JSON_VALUES": 100000,     # most JSON values (object keys too) in one request body
        "BACKEND": "django",               # create_memory_store(): memory | django | redis
        "BACKEND_FALLBACK": True,          # a backend failing to start falls back to memory (False: raise)
        "REDIS_URL": "",                   # Redis backend URL ("": the REDIS_URL variable, else localhost)
        "REDIS_KEY_PREFIX": "afkmemory:",  # prefix of every Redis key (isolates tenants sharing a server)
        "REDIS_THREAD_TTL": None,          # seconds a thread lives after its last write (None: forever)
        "REDIS_MAX_CONNECTIONS": 50,       # connections per pool (one pool per event loop)
        "REDIS_SOCKET_TIMEOUT": 5.0,       # seconds per Redis command, and to wait for a free connection
        "REDIS_CONNECT_TIMEOUT": 5.0,      # seconds to connect to Redis
    }

The backend keys are overridden by AFK's environment variables (``AFK_MEMORY_BACKEND``,
``AFK_MEMORY_BACKEND_FALLBACK``, ``AFK_REDIS_URL``, ``AFK_REDIS_KEY_PREFIX``,
``AFK_REDIS_THREAD_TTL``, ``AFK_REDIS_MAX_CONNECTIONS``, ``AFK_REDIS_SOCKET_TIMEOUT``,
``AFK_REDIS_CONNECT_TIMEOUT``) when ``afkmemory.memory.create_memory_store`` reads them.

Read values as attributes: ``from afkmemory.conf import afk_settings;
afk_settings.EMBEDDING_DIMENSIONS``. The object reloads when a test overrides
``AFKMEMORY`` with ``override_settings``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

#: The most rows one DELETE of a compaction or a sweep may remove (``DELETE_BATCH_SIZE``, a sweep's
#: ``batch_size``): each id is a parameter on SQLite, and a batch's locks are held while it runs.
MAX_DELETE_BATCH_SIZE = 10_000

#: The longest ``JOB_LEASE_SECONDS``: a year. A claim past the year 9999 cannot be written at all.
MAX_JOB_LEASE_SECONDS = 366 * 24 * 3600

#: The whole-number settings: their lowest and highest values (None: no bound) and what they are.
WHOLE_NUMBERS: dict[str, tuple[int, int | None, str]] = {
    "ASYNC_POOL_SIZE": (1, None, "the most connections of the async stores per event loop and database"),
    # pgvector's own ranges: m 2..100, ef_construction 4..1000, ef_search 1..1000.
    "HNSW_M": (2, 100, "the HNSW graph's degree (index build)"),
    "HNSW_EF_CONSTRUCTION": (4, 1000, "the HNSW build's candidate list"),
    "HNSW_EF_SEARCH": (1, 1000, "a vector search's HNSW candidate list"),
    "HNSW_MAX_SCAN_TUPLES": (1, 2**31 - 1, "the most rows pgvector's iterative scan reads"),
    "EXACT_SEARCH_THRESHOLD": (0, None, "how many candidates a vector search ranks exactly"),
    "HNSW_TUPLE_COST": (0, 10_000, "how many exact rankings an HNSW index tuple costs"),
    "DELETE_BATCH_SIZE": (1, MAX_DELETE_BATCH_SIZE, "the rows one DELETE of a compaction or a sweep removes"),
    "JOB_LEASE_SECONDS": (1, MAX_JOB_LEASE_SECONDS, "how long a scheduled job's claim outlives a crashed worker"),
    "API_MAX_PAGE_SIZE": (1, None, "the largest page the REST API serves"),
    "API_MAX_VALUE_BYTES": (1, None, "the largest JSON value the REST API stores"),
    "API_MAX_JSON_VALUES": (1, None, "the most JSON values (object keys too) in a REST request body"),
}

DEFAULTS: dict[str, Any] = {
    "EMBEDDING_DIMENSIONS": 1536,
    "TEXT_SEARCH_CONFIG": "english",
    "HNSW_M": 16,
    "HNSW_EF_CONSTRUCTION": 64,
    "HNSW_EF_SEARCH": 100,
    "HNSW_MAX_SCAN_TUPLES": 20_000,
    "EXACT_SEARCH_THRESHOLD": 500,
    "HNSW_TUPLE_COST": 16,
    "DELETE_BATCH_SIZE": 500,
    "COMPACTION_POLICY": {"max_events_per_thread": 5000, "keep_event_types": ["trace"], "scan_limit": 20_000},
    "STATE_RETENTION_POLICY": {},
    "GRAPH_CHECKPOINT_RETENTION": {},
    "JOB_LEASE_SECONDS": 3600,
    "DATABASE_ALIAS": "default",
    "ASYNC_POOL": False,
    "ASYNC_POOL_SIZE": 10,
    "ASYNC_POOL_PREPARE": True,
    "API_MAX_PAGE_SIZE": 500,
    "API_MAX_VALUE_BYTES": 1_048_576,
    "API_MAX_JSON_VALUES": 100_000,
    "BACKEND": "django",
    "BACKEND_FALLBACK": True,
    "REDIS_URL": "",
    "REDIS_KEY_PREFIX": "afkmemory:",
    "REDIS_THREAD_TTL": None,
    "REDIS_MAX_CONNECTIONS": 50,
    "REDIS_SOCKET_TIMEOUT": 5.0,
    "REDIS_CONNECT_TIMEOUT": 5.0,
}


def user_settings() -> dict[str, Any]:
    """``settings.AFKMEMORY``, or ``{}`` without one; ImproperlyConfigured if it is not a dict (E000)."""
    user = getattr(settings, "AFKMEMORY", {})
    if not isinstance(user, dict):  # [] or None too: an empty list is not "no settings"
        raise ImproperlyConfigured(f"settings.AFKMEMORY must be a dict, got {type(user).__name__}.")
    return user


class AfkMemorySettings:
    """Attribute access to ``settings.AFKMEMORY``, falling back to ``DEFAULTS``."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name not in DEFAULTS:
            raise AttributeError(f"unknown afkmemory setting {name!r}; known: {sorted(DEFAULTS)}")
        if name not in self._cache:
            self._cache[name] = user_settings().get(name, DEFAULTS[name])
        return self._cache[name]

    def whole_number(self, name: str) -> int:
        """Setting ``name`` of ``WHOLE_NUMBERS``; ImproperlyConfigured, naming it, outside its range.

        The system checks refuse such a value at startup (E003, E006), but a Celery worker or
        a script runs without them: the jobs and the deletes read these settings through
        here, so a bad value stops them before they claim or delete anything (a lease of 0
        let two runs of a job through at once, None kept its claim forever, a batch of 0
        reported rows deleted that were not).
        """
        value = getattr(self, name)
        low, high, _meaning = WHOLE_NUMBERS[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f">= {low}"
            raise ImproperlyConfigured(f"AFKMEMORY[{name!r}] must be a whole number {bounds}, got {value!r}.")
        return value

    def reload(self) -> None:
        self._cache.clear()


afk_settings = AfkMemorySettings()


def check_afkmemory_database(using: str) -> str:
    """Return ``using`` if ``DATABASE_ROUTERS`` let afkmemory's tables live there; else ImproperlyConfigured.

    A job or command run on another alias found no tables (a raw "no such table"), or,
    worse, an old copy of them that it quietly swept and compacted.
    """
    from django.db import router

    if not router.allow_migrate(using, "afkmemory"):
        raise ImproperlyConfigured(
            f"database {using!r} does not hold afkmemory's tables (DATABASE_ROUTERS keep them out of it): "
            f"use the alias they live on, AFKMEMORY['DATABASE_ALIAS'] ({afk_settings.DATABASE_ALIAS!r}) by default"
        )
    return using


def reload_settings(*, setting: str, **kwargs: Any) -> None:
    """Forget cached values when a test overrides ``AFKMEMORY`` (a ``setting_changed`` receiver)."""
    if setting == "AFKMEMORY":
        afk_settings.reload()
