"""Workload 5: the REST API under load — ``GET state/{key}`` and ``POST events/`` against a bare endpoint.

gunicorn serves the example project (``bench.settings``: DEBUG off, persistent database
connections) with 2 sync workers, its default: one request at a time per worker, one
connection per request. (With keep-alive, gthread workers, each of the 8 callers' connections
sticks to the worker that accepted it, and one worker often took most of them: c8
throughput then varied 2x between runs.) ``bench.loadgen`` drives it from another process:
one caller (seq) or 8 callers (c8), for a fixed time. The bare DRF endpoint
(``bench.urls``) has the same middleware, authentication and permissions and does no
work: afkmemory's endpoints are compared with it. A second server, the same but for its
database alias (Django's ``server_side_binding`` and psycopg's prepared statements,
bench/settings.py), serves the ``POST`` pair again: the rows "... (prepared alias)".

Where the time goes: the CPU the gunicorn workers and their PostgreSQL backends spend
per request, read from ``/proc`` around each round (Linux, with the server on this
machine; elsewhere the columns stay empty). On 2 cores shared by the load generator,
the workers and the server, that CPU is what bounds the 8-caller rates.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from .measure import Result, Round, Scale, summarize
from .report import PREPARED_SERVER

log = logging.getLogger("bench")
ROOT = Path(__file__).resolve().parent.parent
THREAD = "rest-thread"
STATE_KEY = "profile"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gunicorn(port: int, *, prepared: bool = False) -> subprocess.Popen:
    """Start gunicorn on ``port`` (``wait_until_up`` tells when it answers)."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings", "AFKMEMORY_BENCH_PREPARED": str(int(prepared))}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "--workers",
            "2",
            "--worker-class",
            "sync",
            "--bind",
            f"127.0.0.1:{port}",
            "--log-level",
            "warning",
            "project.wsgi:application",
        ],
        cwd=ROOT,
        env=env,
    )
    return proc


def wait_until_up(proc: subprocess.Popen, port: int) -> None:
    """Return once gunicorn on ``port`` answers; stop it and raise if it does not within 30 s."""
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/bench/up/", timeout=1)
        except urllib.error.HTTPError:
            return  # answering (404 is fine)
        except OSError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError("gunicorn exited at start")
    proc.terminate()
    raise RuntimeError("gunicorn did not answer within 30 s")


def credentials() -> tuple[dict[str, str], Any]:
    """Return the headers of an authenticated API client (a user and a DRF token)."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    user, _ = get_user_model().objects.get_or_create(username="bench")
    token, _ = Token.objects.get_or_create(user=user)
    return {"Authorization": f"Token {token.key}", "Accept": "application/json"}, user


def endpoints(headers: dict[str, str], user: Any) -> dict[str, dict[str, Any]]:
    """Return the requests to measure, after writing what the GETs read."""
    from afkmemory.stores import SyncDjangoMemoryStore

    SyncDjangoMemoryStore(owner=user).put_state(THREAD, STATE_KEY, {"name": "Ada", "plan": "pro", "seen": 42})
    post_headers = {**headers, "Content-Type": "application/json"}
    event = json.dumps(
        {
            "id": "ev-{n}",
            "user_id": "u1",
            "type": "message",
            "timestamp": 1_700_000_000_000,
            "payload": {"role": "user", "content": "what did we decide about the plan?"},
        }
    )
    requests = {
        "GET state/{key}": {"method": "GET", "path": f"/api/v1/threads/{THREAD}/state/{STATE_KEY}", "headers": headers},
        "GET bare endpoint": {"method": "GET", "path": "/bench/bare/", "headers": headers},
        "POST events/": {
            "method": "POST",
            "path": f"/api/v1/threads/{THREAD}/events/",
            "headers": post_headers,
            "body": event.replace("ev-{n}", "ev-{n}-R"),
        },
        "POST bare endpoint": {"method": "POST", "path": "/bench/bare/", "headers": post_headers, "body": event},
    }
    again = ("POST events/", "POST bare endpoint")  # on the second server too
    return {**requests, **{f"{name}{PREPARED_SERVER}": requests[name] for name in again}}


def load(port: int, request: dict[str, Any], concurrency: int, seconds: float, tag: str) -> tuple[Round, dict]:
    req = {**request, "body": request.get("body", "").replace("-R", f"-{tag}")}
    spec = {"port": port, "concurrency": concurrency, "seconds": seconds, "max_requests": 1_000_000, "requests": [req]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "bench.loadgen", fh.name],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=seconds + 60,
            check=True,
        )
    finally:
        os.unlink(fh.name)
    got = json.loads(out.stdout)
    return Round(got["seconds"], got["latencies"]), {"statuses": got["statuses"], "errors": got["errors"]}


class CpuMeter:
    """CPU seconds spent so far by gunicorn's workers and by the database's other backends."""

    def __init__(self, gunicorn_pid: int, url: str) -> None:
        import psycopg

        self.gunicorn_pid = gunicorn_pid
        self.conn = psycopg.connect(url, autocommit=True)

    def _pids(self) -> tuple[list[int], list[int]]:
        workers = [pid for pid in _pids() if _stat(pid)[1] == self.gunicorn_pid]
        rows = self.conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
        ).fetchall()
        return workers, [pid for (pid,) in rows if _is_postgres(pid)]

    def read(self) -> tuple[dict[int, float], dict[int, float]] | None:
        """CPU seconds of each worker and each backend, or None where ``/proc`` does not show them."""
        workers, backends = self._pids()
        if not workers or not backends:
            return None
        return {p: _stat(p)[0] for p in workers}, {p: _stat(p)[0] for p in backends}

    @staticmethod
    def spent(before: dict[int, float], after: dict[int, float]) -> float:
        """CPU seconds spent between two readings by the processes in both (a restarted worker is left out)."""
        return sum(after[pid] - before[pid] for pid in before.keys() & after.keys())

    def close(self) -> None:
        self.conn.close()


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()] if os.path.isdir("/proc") else []


def _stat(pid: int) -> tuple[float, int]:
    """``(user + system CPU seconds, parent pid)`` of ``pid``, or ``(0.0, 0)`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[1])


def _is_postgres(pid: int) -> bool:
    """Whether ``pid`` is a PostgreSQL process on this machine (a remote server's pids are not)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().startswith(b"postgres")
    except OSError:
        return False


def run(scale: Scale, url: str) -> list[Result]:
    from django.db import connections

    headers, user = credentials()
    requests = endpoints(headers, user)
    connections.close_all()
    ports = {prepared: _free_port() for prepared in (False, True)}
    servers: dict[bool, subprocess.Popen] = {}
    meters: dict[bool, CpuMeter] = {}
    results = []

    def on_prepared(name: str) -> bool:
        """Whether ``name`` is served by the second server, whose alias prepares."""
        return name.endswith(PREPARED_SERVER)

    def send(name: str, concurrency: int, seconds: float, tag: str) -> tuple[Round, dict]:
        """One round of ``name`` on its server; the tag keeps each round's event ids apart."""
        prepared = on_prepared(name)
        return load(ports[prepared], requests[name], concurrency, seconds, f"{tag}{'p' if prepared else ''}")

    try:
        # Both servers start at once (each imports Django in three processes): the set-up takes
        # the time of one start, not two. Nothing is measured before both answer.
        for prepared, port in ports.items():
            servers[prepared] = start_gunicorn(port, prepared=prepared)
        for prepared, port in ports.items():
            wait_until_up(servers[prepared], port)
            meters[prepared] = CpuMeter(servers[prepared].pid, url)
        if not scale.smoke:
            for name in requests:  # warm both workers' connections and caches
                send(name, 2, 1.0, "warm")
        names = list(requests)
        for mode, concurrency in (("seq", 1), ("c8", 8)):
            rounds: dict[str, list[Round]] = {n: [] for n in names}
            seen_all: dict[str, dict] = {n: {} for n in names}
            cpu: dict[str, list[float] | None] = {n: [0.0, 0.0] for n in names}
            for r in range(scale.rest_rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    meter = meters[on_prepared(name)]
                    before = meter.read()
                    rnd, seen = send(name, concurrency, scale.rest_seconds, f"{mode}{r}")
                    after = meter.read()
                    spent = cpu[name]
                    if before and after and spent is not None:
                        spent[0] += meter.spent(before[0], after[0])
                        spent[1] += meter.spent(before[1], after[1])
                    else:
                        cpu[name] = None
                    rounds[name].append(rnd)
                    for s, c in seen["statuses"].items():
                        seen_all[name][s] = seen_all[name].get(s, 0) + c
                    seen_all[name]["errors"] = seen_all[name].get("errors", 0) + seen["errors"]
            for name in names:
                bad = {k: v for k, v in seen_all[name].items() if k != "errors" and not 200 <= int(k) < 300}
                if bad or seen_all[name]["errors"]:
                    raise AssertionError(f"REST {name}: unexpected answers {seen_all[name]}")
                spent = cpu[name]
                requests_sent = sum(len(rnd.latencies) for rnd in rounds[name])
                per_request = {}
                if spent is not None and requests_sent:
                    per_request = {
                        "worker_cpu_ms": 1000 * spent[0] / requests_sent,
                        "db_cpu_ms": 1000 * spent[1] / requests_sent,
                    }
                res = summarize(
                    "rest",
                    name.split(" ", 1)[0],
                    name,
                    mode,
                    rounds[name],
                    answers=seen_all[name],
                    round_rates=[round(rnd.rate) for rnd in rounds[name]],
                    **per_request,
                )
                log.info(
                    "  rest       %-36s %-4s %8.0f req/s  p50 %7.2f ms  p99 %7.2f ms  CPU ms/req %s  %s",
                    name,
                    mode,
                    res.ops_per_s,
                    res.p50_ms,
                    res.p99_ms,
                    {k: round(v, 3) for k, v in per_request.items()},
                    seen_all[name],
                )
                results.append(res)
    finally:
        for meter in meters.values():
            meter.close()
        for proc in servers.values():
            proc.terminate()
        for proc in servers.values():
            proc.wait(timeout=30)
    return results
