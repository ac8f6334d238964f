"""What afkmemory's management commands share."""

from __future__ import annotations

import argparse

from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from afkmemory.conf import afk_settings, check_afkmemory_database


def database_alias(value: str) -> str:
    """``--database``: one of ``settings.DATABASES``' aliases (a usage error, not a traceback, otherwise)."""
    if value not in connections.settings:
        raise argparse.ArgumentTypeError(f"no database {value!r}; the aliases are {', '.join(connections.settings)}")
    return value


def afkmemory_database(value: str) -> str:
    """``--database`` of a command on afkmemory's tables: an alias ``DATABASE_ROUTERS`` lets them live on."""
    try:
        return check_afkmemory_database(database_alias(value))
    except ImproperlyConfigured as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_database_argument(
    parser: argparse.ArgumentParser, what: str = "Database alias", *, tables: bool = True
) -> None:
    """``--database``, by default ``AFKMEMORY["DATABASE_ALIAS"]`` (the REST API's database).

    ``tables``: the command works on afkmemory's tables, so the alias must be one the
    routers let them live on (not ``afkmemory_issue_token``'s, which names the accounts').
    """
    alias = afk_settings.DATABASE_ALIAS
    parser.add_argument(
        "--database",
        type=afkmemory_database if tables else database_alias,
        default=alias,
        help=f"{what} (default: AFKMEMORY['DATABASE_ALIAS'], {alias!r}).",
    )
