"""The benchmark harness still runs: ``python -m bench.run --smoke`` produces every workload's results.

It asserts that the code runs and reports, never a time (CI's machine is shared). The run
uses this test session's PostgreSQL (``AFKMEMORY_BENCH_PG_URL``), in a database of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pg import postgres_url

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

#: How the store workloads name a store's configurations (the rows its verdicts are judged on).
SUFFIXES = ("", " in own_thread()", "(async_pool=True)", " on a prepared alias")


#: Every implementation each workload measures, as the report's verdicts and tables name them.
EXPECTED_IMPLS = {
    "store": {
        *(f"DjangoStore{suffix}" for suffix in SUFFIXES),
        "raw psycopg (DjangoStore's SQL)",
        "agentflow PostgresStore",
        "LangGraph AsyncPostgresStore",
        "SyncDjangoStore (threads)",
    },
    "memory": {
        *(f"DjangoMemoryStore{suffix}" for suffix in SUFFIXES),
        "raw psycopg (same SQL)",
        "SyncDjangoMemoryStore (threads)",
    },
    "vector": {
        "afkmemory (as shipped)",
        "afkmemory through HNSW (HNSW_TUPLE_COST 0)",
        "afkmemory(async_pool=True) (as shipped)",
        "afkmemory(async_pool=True) through HNSW",
        "afkmemory on a prepared alias (as shipped)",
        "exact scan of all rows (filter in the scan)",
        "HNSW, unfiltered (raw SQL)",
        "exact scan, unfiltered (raw SQL)",
        "afkmemory without HNSW index",
        "exact scan of all rows, beside the row without HNSW",
    },
    "cleanup": {
        "compact_thread to 50",
        "SyncDjangoStore.sweep_expired (batched)",
        "one DELETE (LangGraph's sweep_ttl)",
    },
    "rest": {
        "GET state/{key}",
        "GET bare endpoint",
        "POST events/",
        "POST bare endpoint",
        "POST events/ (prepared alias)",
        "POST bare endpoint (prepared alias)",
    },
}


def test_smoke_run_produces_results_for_every_workload(tmp_path: Path) -> None:
    from bench.report import TARGETS, targets
    from bench.run import WORKLOADS

    env = {**os.environ, "AFKMEMORY_BENCH_PG_URL": postgres_url()}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads((tmp_path / "results.json").read_text())
    results = data["results"]
    for workload in WORKLOADS:
        rows = [r for r in results if r["workload"] == workload]
        assert rows, f"no results for {workload}"
        assert all(r["ops"] > 0 and r["ops_per_s"] > 0 for r in rows), workload
    # The verdicts are found by implementation name: a renamed one would drop its verdicts silently.
    for workload, impls in EXPECTED_IMPLS.items():
        found = {r["impl"] for r in results if r["workload"] == workload}
        assert impls <= found, f"{workload}: no results for {sorted(impls - found)}"
    assert {target for target, *_ in targets(results)} == set(TARGETS)
    assert data["meta"]["commit"] and data["meta"]["runs"].keys() == set(WORKLOADS)
    report = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## Targets" in report and "## 5. REST API under load" in report
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {
        f"{w}.png" for w in ("store", "memory", "vector", "cleanup", "rest")
    }
