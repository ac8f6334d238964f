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


def test_smoke_run_produces_results_for_every_workload(tmp_path: Path) -> None:
    from bench.run import WORKLOADS

    env = {**os.environ, "AFKMEMORY_BENCH_PG_URL": postgres_url()}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    for workload in WORKLOADS:
        rows = [r for r in results if r["workload"] == workload]
        assert rows, f"no results for {workload}"
        assert all(r["ops"] > 0 and r["ops_per_s"] > 0 for r in rows), workload
    report = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## Targets" in report and "## 5. REST API under load" in report
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {
        f"{w}.png" for w in ("store", "memory", "vector", "cleanup", "rest")
    }
