"""``create_memory_store``: the MemoryStore backend chosen by settings and the environment.

Each option is resolved in this order: an argument of ``create_memory_store``, then the
environment variable (AFK's names, so an AFK deployment's environment keeps working),
then ``settings.AFKMEMORY`` when Django is configured, then the backend's own default.
Without Django configured the default backend is ``memory``; with it, ``django``.
Nothing here imports Django unless Django is configured or the ``django`` backend is
chosen, and nothing imports redis unless ``redis`` is.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .base import MemoryStore
from .inmemory import InMemoryMemoryStore

logger = logging.getLogger(__name__)

#: Accepted names of each backend: AFK's spellings too, its SQL backends' meaning the database
#: Django has (``DATABASE_ALIAS``), not ``AFK_SQLITE_PATH`` or ``AFK_PG_DSN``.
BACKEND_NAMES = {
    "memory": "memory",
    "inmemory": "memory",
    "in_memory": "memory",
    "mem": "memory",
    "django": "django",
    "sqlite": "django",
    "sqlite3": "django",
    "pg": "django",
    "postgres": "django",
    "postgresql": "django",
    "redis": "redis",
}

#: AFK's variables for its own SQL backends, which the ``django`` backend does not read.
_AFK_SQL_VARIABLES = ("AFK_SQLITE_PATH", "AFK_PG_DSN", "AFK_PG_HOST", "AFK_PG_DB")


class MemoryBackendError(RuntimeError):
    """The configured memory backend could not be initialized and fallback is off."""


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _optional_seconds(text: str) -> float | None:
    return None if text.strip().lower() in ("", "none") else float(text)


#: ``AFKMEMORY`` key -> (environment variable that overrides it, parser of its text).
ENVIRONMENT: dict[str, tuple[str, Callable[[str], Any]]] = {
    "BACKEND": ("AFK_MEMORY_BACKEND", str),
    "BACKEND_FALLBACK": ("AFK_MEMORY_BACKEND_FALLBACK", _boolean),
    "REDIS_URL": ("AFK_REDIS_URL", str),
    "REDIS_KEY_PREFIX": ("AFK_REDIS_KEY_PREFIX", str),
    "REDIS_THREAD_TTL": ("AFK_REDIS_THREAD_TTL", _optional_seconds),
    "REDIS_MAX_CONNECTIONS": ("AFK_REDIS_MAX_CONNECTIONS", int),
    "REDIS_SOCKET_TIMEOUT": ("AFK_REDIS_SOCKET_TIMEOUT", float),
    "REDIS_CONNECT_TIMEOUT": ("AFK_REDIS_CONNECT_TIMEOUT", float),
}

#: Per backend: constructor argument -> the ``AFKMEMORY`` key that configures it.
OPTIONS: dict[str, dict[str, str | None]] = {
    "memory": {"embedding_dimensions": "EMBEDDING_DIMENSIONS"},
    "django": {"using": "DATABASE_ALIAS", "owner": None},
    "redis": {
        "url": "REDIS_URL",
        "key_prefix": "REDIS_KEY_PREFIX",
        "thread_ttl": "REDIS_THREAD_TTL",
        "max_connections": "REDIS_MAX_CONNECTIONS",
        "socket_timeout": "REDIS_SOCKET_TIMEOUT",
        "socket_connect_timeout": "REDIS_CONNECT_TIMEOUT",
        "pool_timeout": None,
        "client_name": None,
        "embedding_dimensions": "EMBEDDING_DIMENSIONS",
    },
}

#: Settings without an environment variable: the schema's embedding length, and the
#: database alias the REST API uses too (an override of only one of them would split them).
_SETTINGS_ONLY = ("EMBEDDING_DIMENSIONS", "DATABASE_ALIAS")


def _django_settings() -> dict[str, Any]:
    """Return the ``AFKMEMORY`` values the factory reads, or {} if Django is not configured."""
    if "django.conf" not in sys.modules and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        return {}  # nothing configured Django: it is not even imported
    from django.conf import settings

    if not (settings.configured or os.environ.get("DJANGO_SETTINGS_MODULE")):
        return {}
    from afkmemory.conf import afk_settings

    return {key: getattr(afk_settings, key) for key in (*ENVIRONMENT, *_SETTINGS_ONLY)}


def resolve_settings() -> dict[str, Any]:
    """Return the backend settings in force: ``AFKMEMORY`` overridden by the environment."""
    values = _django_settings()
    for key, (variable, parse) in ENVIRONMENT.items():
        text = os.environ.get(variable)
        if text is not None:
            try:
                values[key] = parse(text)
            except ValueError as exc:
                raise ValueError(f"environment variable {variable}={text!r} is invalid: {exc}") from exc
    return values


def create_memory_store(backend: str | None = None, *, fallback: bool | None = None, **options: Any) -> MemoryStore:
    """Return the MemoryStore ``backend`` names: ``memory``, ``django`` or ``redis``.

    ``backend`` defaults to ``AFK_MEMORY_BACKEND``, else ``AFKMEMORY["BACKEND"]``.
    ``options`` are constructor arguments of the chosen store (``url=``, ``key_prefix=``,
    ``using=`` ...) and win over settings. Initializing means constructing the store
    and, for Redis, one PING (so this call blocks up to the connect timeout); for
    Django, finding the app and the database alias.

    If that fails, log a warning saying why and return an ``InMemoryMemoryStore``, as
    AFK's runner does; with ``fallback=False`` (or ``AFKMEMORY["BACKEND_FALLBACK"] =
    False``, or ``AFK_MEMORY_BACKEND_FALLBACK=0``), raise ``MemoryBackendError`` instead:
    in production, a store that silently forgets everything on restart is worse than
    a failed start. An unknown backend name or option, or a bad option value (a URL that
    is not Redis's, a negative ttl), is a ``ValueError``/``TypeError`` either way: it is a
    typo to fix, not an outage to ride out.
    """
    values = resolve_settings()
    requested = backend if backend is not None else values.get("BACKEND", "memory")
    name = _backend_name(requested)
    ignored = [variable for variable in _AFK_SQL_VARIABLES if os.environ.get(variable)]
    if name == "django" and ignored:
        logger.warning(
            "memory backend %r is afkmemory's django backend on DATABASES[%r]; it does not read %s "
            "(point DATABASE_ALIAS, or DATABASES, at that database instead)",
            requested,
            options.get("using", values.get("DATABASE_ALIAS", "default")),
            ", ".join(ignored),
        )
    unknown = set(options) - set(OPTIONS[name])
    if unknown:
        raise TypeError(f"the {name} backend takes no option {sorted(unknown)}; it takes {sorted(OPTIONS[name])}")
    arguments = {**_arguments(name, values), **options}
    strict = not _fallback(fallback if fallback is not None else values.get("BACKEND_FALLBACK", True))

    try:
        return _BUILDERS[name](arguments)
    except (TypeError, ValueError):  # an option's value (a bad URL, a negative ttl): a typo, not an outage
        raise
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        if strict:
            raise MemoryBackendError(f"memory backend {name!r} could not be initialized: {reason}") from exc
        logger.warning(
            "memory backend %r could not be initialized (%s); falling back to the in-memory store, "
            "which keeps nothing across restarts and shares nothing between processes. "
            "Set AFKMEMORY['BACKEND_FALLBACK'] = False or AFK_MEMORY_BACKEND_FALLBACK=0 to fail instead.",
            name,
            reason,
        )
        # The length the memory backend would check, whichever backend failed.
        dimensions = arguments.get("embedding_dimensions", values.get("EMBEDDING_DIMENSIONS"))
        return InMemoryMemoryStore(embedding_dimensions=dimensions if isinstance(dimensions, int) else None)


def _backend_name(requested: Any) -> str:
    if not isinstance(requested, str) or requested.strip().lower() not in BACKEND_NAMES:
        raise ValueError(
            f"unknown memory backend {requested!r}; choose one of memory, django, redis "
            "(AFK_MEMORY_BACKEND or AFKMEMORY['BACKEND'])"
        )
    return BACKEND_NAMES[requested.strip().lower()]


def _fallback(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"BACKEND_FALLBACK (or fallback=) must be True or False, got {value!r}")
    return value


def _arguments(name: str, values: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments of backend ``name`` that the settings in force give."""
    arguments = {
        argument: values[key]
        for argument, key in OPTIONS[name].items()
        if key is not None and values.get(key) not in (None, "")
    }
    if name == "redis":
        arguments.setdefault("url", os.environ.get("REDIS_URL") or "redis://localhost:6379/0")
    return arguments


def settings_problems() -> list[str]:
    """What is wrong with the backend settings in force (``AFKMEMORY`` under AFK's variables), each a sentence.

    What ``create_memory_store()`` would raise for, found at start-up (system check
    ``afkmemory.E008``) rather than at its first call. The Redis options are checked
    when redis is installed.
    """
    problems: list[str] = []
    try:
        values = resolve_settings()
    except ValueError as exc:  # an environment variable's text
        return [str(exc)]
    for check in (
        lambda: _backend_name(values.get("BACKEND", "memory")),
        lambda: _fallback(values.get("BACKEND_FALLBACK", True)),
    ):
        try:
            check()
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
    try:
        from .redis import RedisMemoryStore
    except ImportError:
        return problems
    try:
        RedisMemoryStore(**_arguments("redis", values))  # checks its options; connects at first use
    except (TypeError, ValueError) as exc:
        problems.append(f"the Redis backend's settings: {exc}")
    return problems


def _memory(arguments: dict[str, Any]) -> MemoryStore:
    return InMemoryMemoryStore(**arguments)


def _django(arguments: dict[str, Any]) -> MemoryStore:
    from afkmemory.stores import DjangoMemoryStore

    # An alias settings.DATABASES lacks is ConnectionDoesNotExist: the database is not there, fall back.
    return DjangoMemoryStore(owner=arguments.get("owner"), using=arguments.get("using", "default"))


def _redis(arguments: dict[str, Any]) -> MemoryStore:
    from .redis import RedisMemoryStore

    store = RedisMemoryStore(**arguments)
    # PING from a loop of its own in a thread of its own: this works whether or not the
    # caller runs an event loop, and that loop's pool is disconnected when it closes.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="afkmemory-redis-check") as executor:
        executor.submit(lambda: asyncio.run(store.setup())).result()
    return store


_BUILDERS: dict[str, Callable[[dict[str, Any]], MemoryStore]] = {
    "memory": _memory,
    "django": _django,
    "redis": _redis,
}
