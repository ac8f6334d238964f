"""create_memory_store: which backend, with which options, and what happens when it fails."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.test import override_settings

from afkmemory.conf import DEFAULTS
from afkmemory.memory import InMemoryMemoryStore, MemoryBackendError, create_memory_store
from afkmemory.memory.factory import ENVIRONMENT
from afkmemory.memory.redis import RedisMemoryStore, RedisMemoryStoreError
from tests.redis_server import delete_prefix, require_redis, unique_prefix
from tests.test_redis_store import socketless_port

ROOT = Path(__file__).resolve().parent.parent
FACTORY_LOGGER = "afkmemory.memory.factory"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No AFK_* variable of the machine running the tests leaks into them."""
    for variable, _ in ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)


def afkmemory(**overrides):
    return override_settings(AFKMEMORY={**settings.AFKMEMORY, **overrides})


@pytest.fixture
def url() -> str:
    return require_redis()


@pytest.fixture
def prefix(url):
    prefix = unique_prefix()
    yield prefix
    delete_prefix(url, prefix)


# -- choosing -----------------------------------------------------------------------------------


def test_memory_backend_and_its_spellings():
    for name in ("memory", "MEMORY", "inmemory", "in_memory", "mem"):
        store = create_memory_store(name)
        assert type(store) is InMemoryMemoryStore
        assert store.embedding_dimensions == 8  # AFKMEMORY["EMBEDDING_DIMENSIONS"] of the tests


@pytest.mark.parametrize("name", ["sqlite", "sqlite3", "pg", "postgres", "postgresql"])
def test_afks_sql_backend_names_mean_the_django_backend(monkeypatch, caplog, name):
    """AFK's own default is AFK_MEMORY_BACKEND=sqlite: an AFK deployment's environment raised
    "unknown memory backend". Its SQL backends' own variables are not read, and it says so."""
    from afkmemory.stores import DjangoMemoryStore

    monkeypatch.setenv("AFK_MEMORY_BACKEND", name)
    assert isinstance(create_memory_store(), DjangoMemoryStore)
    assert FACTORY_LOGGER not in {r.name for r in caplog.records}
    monkeypatch.setenv("AFK_PG_DSN", "postgresql://elsewhere/afk")
    with caplog.at_level(logging.WARNING, logger=FACTORY_LOGGER):
        assert create_memory_store().sync.using == "default"
    assert "it does not read AFK_PG_DSN (point" in caplog.text


def test_django_is_the_default_under_django_on_the_configured_alias():
    from afkmemory.stores import DjangoMemoryStore

    store = create_memory_store()
    assert isinstance(store, DjangoMemoryStore) and store.sync.using == "default"
    with afkmemory(DATABASE_ALIAS="postgres"):
        assert create_memory_store().sync.using == "postgres"
    assert create_memory_store("django", using="postgres").sync.using == "postgres"


def test_the_environment_wins_over_settings_and_arguments_over_both(monkeypatch, url, prefix):
    with afkmemory(BACKEND="django", REDIS_URL=url, REDIS_KEY_PREFIX="from-settings:"):
        monkeypatch.setenv("AFK_MEMORY_BACKEND", "memory")
        assert type(create_memory_store()) is InMemoryMemoryStore
        monkeypatch.setenv("AFK_MEMORY_BACKEND", "redis")
        monkeypatch.setenv("AFK_REDIS_KEY_PREFIX", prefix)
        assert create_memory_store().key_prefix == prefix
        assert create_memory_store(key_prefix="from-argument:").key_prefix == "from-argument:"
        assert type(create_memory_store("memory")) is InMemoryMemoryStore


def test_redis_takes_every_option_from_settings(url, prefix):
    options = dict(REDIS_URL=url, REDIS_KEY_PREFIX=prefix, REDIS_THREAD_TTL=30, REDIS_MAX_CONNECTIONS=7,
                   REDIS_SOCKET_TIMEOUT=2.5, REDIS_CONNECT_TIMEOUT=1.5)  # fmt: skip
    with afkmemory(BACKEND="redis", **options):
        store = create_memory_store()
    assert isinstance(store, RedisMemoryStore)
    assert (store.url, store.key_prefix, store.thread_ttl) == (url, prefix, 30)
    assert (store.max_connections, store.socket_timeout, store.socket_connect_timeout) == (7, 2.5, 1.5)
    assert store.capabilities.ttl and store.embedding_dimensions == 8
    asyncio.run(store.put_state("t1", "k", {"v": 1}))
    assert asyncio.run(store.get_state("t1", "k")) == {"v": 1}


def test_redis_options_from_the_environment(monkeypatch, url, prefix):
    for variable, value in [("AFK_REDIS_URL", url), ("AFK_REDIS_KEY_PREFIX", prefix), ("AFK_REDIS_THREAD_TTL", "12.5"),
                            ("AFK_REDIS_MAX_CONNECTIONS", "9"), ("AFK_REDIS_SOCKET_TIMEOUT", "3"),
                            ("AFK_REDIS_CONNECT_TIMEOUT", "0.5")]:  # fmt: skip
        monkeypatch.setenv(variable, value)
    store = create_memory_store("redis")
    assert (store.url, store.key_prefix, store.thread_ttl, store.max_connections) == (url, prefix, 12.5, 9)
    assert (store.socket_timeout, store.socket_connect_timeout) == (3.0, 0.5)
    monkeypatch.setenv("AFK_REDIS_THREAD_TTL", "none")
    assert create_memory_store("redis").thread_ttl is None


def test_redis_url_comes_from_REDIS_URL_when_afkmemory_sets_none(monkeypatch, url, prefix):
    monkeypatch.setenv("REDIS_URL", url)
    with afkmemory(REDIS_KEY_PREFIX=prefix):
        assert create_memory_store("redis").url == url
        monkeypatch.setenv("AFK_REDIS_URL", url + "?")  # AFK's own variable comes first
        assert create_memory_store("redis").url == url + "?"


def test_typos_are_errors_not_fallbacks(monkeypatch):
    with pytest.raises(ValueError, match="unknown memory backend 'reddis'"):
        create_memory_store("reddis")
    with pytest.raises(TypeError, match="takes no option"):
        create_memory_store("memory", url="redis://localhost")
    monkeypatch.setenv("AFK_REDIS_MAX_CONNECTIONS", "lots")
    with pytest.raises(ValueError, match="AFK_REDIS_MAX_CONNECTIONS"):
        create_memory_store("memory")
    monkeypatch.setenv("AFK_REDIS_MAX_CONNECTIONS", "5")
    monkeypatch.setenv("AFK_MEMORY_BACKEND_FALLBACK", "maybe")
    with pytest.raises(ValueError, match="AFK_MEMORY_BACKEND_FALLBACK"):
        create_memory_store("memory")


# -- failing to initialize ----------------------------------------------------------------------


def test_unreachable_redis_falls_back_to_memory_with_a_warning_saying_why(caplog):
    with socketless_port() as port, caplog.at_level(logging.WARNING, logger=FACTORY_LOGGER):
        store = create_memory_store("redis", url=f"redis://:s3cret@127.0.0.1:{port}/0", socket_connect_timeout=2)
    assert type(store) is InMemoryMemoryStore and store.embedding_dimensions == 8
    (record,) = [r for r in caplog.records if r.name == FACTORY_LOGGER]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "memory backend 'redis' could not be initialized" in message
    assert f"127.0.0.1:{port}" in message and "ConnectionError" in message  # why: Redis refused
    assert "falling back to the in-memory store" in message and "BACKEND_FALLBACK" in message
    assert "s3cret" not in caplog.text


def test_strict_mode_raises_instead_of_falling_back(monkeypatch, caplog):
    with socketless_port() as port:
        bad = f"redis://127.0.0.1:{port}/0"
        with caplog.at_level(logging.WARNING, logger=FACTORY_LOGGER):
            with afkmemory(BACKEND_FALLBACK=False), pytest.raises(MemoryBackendError) as caught:
                create_memory_store("redis", url=bad)
            assert isinstance(caught.value.__cause__, RedisMemoryStoreError)
            assert "memory backend 'redis' could not be initialized" in str(caught.value)

            monkeypatch.setenv("AFK_MEMORY_BACKEND_FALLBACK", "0")
            with pytest.raises(MemoryBackendError):
                create_memory_store("redis", url=bad)
            monkeypatch.setenv("AFK_MEMORY_BACKEND_FALLBACK", "1")
            with afkmemory(BACKEND_FALLBACK=False):  # the environment wins here too
                assert type(create_memory_store("redis", url=bad)) is InMemoryMemoryStore
            with pytest.raises(MemoryBackendError):
                create_memory_store("redis", url=bad, fallback=False)  # and the argument over both
    assert len([r for r in caplog.records if r.name == FACTORY_LOGGER]) == 1  # only the one fallback


def test_a_bad_option_value_raises_rather_than_falling_back():
    """A typo in a value (not only in a name) is a mistake to fix, not an outage to ride out."""
    for options in ({"url": "redis://127.0.0.1:1/0", "thread_ttl": "abc"}, {"url": "http://cache:6379/0"}):
        with pytest.raises((TypeError, ValueError)):
            create_memory_store("redis", **options)
    with afkmemory(BACKEND_FALLBACK="false"), pytest.raises(TypeError, match="BACKEND_FALLBACK"):
        create_memory_store("django", using="nope")  # "false" is not False: it fell back


def test_django_backend_on_a_missing_alias_falls_back_or_raises(caplog):
    with caplog.at_level(logging.WARNING, logger=FACTORY_LOGGER):
        fallback = create_memory_store("django", using="nope")
    assert type(fallback) is InMemoryMemoryStore
    assert fallback.embedding_dimensions == 8  # checked as the memory backend checks them
    assert "database alias 'nope' is not in settings.DATABASES" in caplog.text
    with pytest.raises(MemoryBackendError, match="'nope'"):
        create_memory_store("django", using="nope", fallback=False)


def test_settings_defaults_match_the_store_defaults():
    """The two places a default lives (AFKMEMORY and RedisMemoryStore) must not drift."""
    signature = inspect.signature(RedisMemoryStore).parameters
    pairs = {
        "REDIS_KEY_PREFIX": "key_prefix",
        "REDIS_THREAD_TTL": "thread_ttl",
        "REDIS_MAX_CONNECTIONS": "max_connections",
        "REDIS_SOCKET_TIMEOUT": "socket_timeout",
        "REDIS_CONNECT_TIMEOUT": "socket_connect_timeout",
    }
    assert {key: DEFAULTS[key] for key in pairs} == {key: signature[arg].default for key, arg in pairs.items()}
    assert set(ENVIRONMENT) <= set(DEFAULTS)


# -- without Django -----------------------------------------------------------------------------

_STANDALONE = """
import asyncio, json, sys
from afkmemory.memory import create_memory_store
store = create_memory_store()
if type(store).__name__ == "RedisMemoryStore":
    asyncio.run(store.put_state("t", "k", 1))
    assert asyncio.run(store.get_state("t", "k")) == 1
print(json.dumps({
    "store": type(store).__name__,
    "django_settings_loaded": "django.conf" in sys.modules and sys.modules["django.conf"].settings.configured,
    "imported": sorted(m for m in ("afkmemory.stores", "afkmemory.conf", "django", "redis") if m in sys.modules),
}))
"""


def standalone(env: dict[str, str]) -> tuple[dict, str]:
    clean = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE" and not k.startswith("AFK_")}
    done = subprocess.run(
        [sys.executable, "-c", _STANDALONE], env={**clean, **env}, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_without_django_the_default_is_memory_and_nothing_else_is_imported():
    result, _ = standalone({})
    assert result == {"store": "InMemoryMemoryStore", "django_settings_loaded": False, "imported": []}


def test_without_django_redis_works_from_the_environment_alone(url, prefix):
    result, _ = standalone({"AFK_MEMORY_BACKEND": "redis", "AFK_REDIS_URL": url, "AFK_REDIS_KEY_PREFIX": prefix})
    assert result == {"store": "RedisMemoryStore", "django_settings_loaded": False, "imported": ["redis"]}


def test_without_django_the_django_backend_falls_back_and_says_so():
    result, stderr = standalone({"AFK_MEMORY_BACKEND": "django"})
    assert result["store"] == "InMemoryMemoryStore"
    assert "memory backend 'django' could not be initialized" in stderr
