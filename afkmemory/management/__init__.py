"""What afkmemory's management commands share."""

from __future__ import annotations

import argparse

from django.db import DEFAULT_DB_ALIAS, connections


def database_alias(value: str) -> str:
    """``--database``: one of ``settings.DATABASES``' aliases (a usage error, not a traceback, otherwise)."""
    if value not in connections.settings:
        raise argparse.ArgumentTypeError(f"no database {value!r}; the aliases are {', '.join(connections.settings)}")
    return value


def add_database_argument(parser: argparse.ArgumentParser, what: str = "Database alias") -> None:
    parser.add_argument("--database", type=database_alias, default=DEFAULT_DB_ALIAS, help=f"{what} (default: default).")
