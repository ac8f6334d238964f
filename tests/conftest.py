"""Shared fixtures: the memory backends the conformance suite runs against."""

from __future__ import annotations

import pytest

from afkmemory.memory import InMemoryMemoryStore

#: Every MemoryStore backend; the conformance suite runs each test once per entry.
#: The Django backends' database aliases ("postgres_bound": server-side binding, prepared; tests/settings.py),
#: shared by the memory, store and checkpointer conformance suites.
DJANGO_ALIASES = {"django-sqlite": "default", "django-postgres": "postgres", "django-postgres-bound": "postgres_bound"}
MEMORY_BACKENDS = ["inmemory", *DJANGO_ALIASES, "redis"]
DIMENSIONS = 8  # tests/settings.py sets AFKMEMORY["EMBEDDING_DIMENSIONS"] to this


@pytest.fixture(params=MEMORY_BACKENDS)
def memory_store(request: pytest.FixtureRequest):
    """A fresh, empty MemoryStore of each backend (modules using it enable both databases)."""
    kind = request.param
    if kind == "inmemory":
        return InMemoryMemoryStore(embedding_dimensions=DIMENSIONS)
    if kind in DJANGO_ALIASES:
        from afkmemory.stores import DjangoMemoryStore

        return DjangoMemoryStore(using=DJANGO_ALIASES[kind])
    if kind == "redis":  # a private key prefix on REDIS_URL or a redis-server of our own; skipped without
        from tests.redis_server import redis_memory_store

        return redis_memory_store(request, embedding_dimensions=DIMENSIONS)
    raise AssertionError(f"unknown backend {kind}")


@pytest.fixture(autouse=True)
def _fresh_table_size_estimates():
    """Vector search remembers the memory table's estimated size for a minute; tests fill and empty it."""
    from afkmemory import indexes
    from afkmemory.stores import memory

    memory._TABLE_ROWS.clear()
    # Text search reads whether the stored text search vectors are searchable every few
    # seconds; tests change the schema (in their transaction) and the configuration.
    indexes.forget_search_vectors()
