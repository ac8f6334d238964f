"""What afkmemory's management commands share."""

from __future__ import annotations

import argparse

from django.db import connections

from afkmemory.conf import afk_settings


def database_alias(value: str) -> str:
    """``--database``: one of ``settings.DATABASES``' aliases (a usage error, not a traceback, otherwise)."""
    if value not in connections.settings:
        raise argparse.ArgumentTypeError(f"no database {value!r}; the aliases are {', '.join(connections.settings)}")
    return value


def add_database_argument(parser: argparse.ArgumentParser, what: str = "Database alias") -> None:
    """``--database``, by default ``AFKMEMORY["DATABASE_ALIAS"]`` (the REST API's database)."""
    alias = afk_settings.DATABASE_ALIAS
    parser.add_argument(
        "--database",
        type=database_alias,
        default=alias,
        help=f"{what} (default: AFKMEMORY['DATABASE_ALIAS'], {alias!r}).",
    )
