"""afkmemory in projects whose settings differ from the example project's.

Each test builds a project under ``tmp_path`` from README's "Installing the app in your
project", varies one setting real projects have, and runs it in a subprocess (settings
such as USE_TZ, DATABASE_ROUTERS and ATOMIC_REQUESTS cannot be overridden in-process
reliably).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: README's install section (SQLite flavour, IMMEDIATE transactions), plus what startproject gives.
BASE_SETTINGS = """
from pathlib import Path
BASE_DIR = Path(__file__).resolve().parent
SECRET_KEY = "review-" + "x" * 60
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["testserver"]
ROOT_URLCONF = "review_urls"
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
TEMPLATES = [{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True, "OPTIONS": {
    "context_processors": ["django.template.context_processors.request",
                           "django.contrib.auth.context_processors.auth",
                           "django.contrib.messages.context_processors.messages"]}}]
INSTALLED_APPS = [
    "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes", "django.contrib.sessions",
    "django.contrib.messages", "django.contrib.staticfiles",
    "rest_framework", "rest_framework.authtoken", "drf_spectacular", "afkmemory",
]
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AFKMEMORY = {"EMBEDDING_DIMENSIONS": 8}
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "db.sqlite3",
                         "OPTIONS": {"transaction_mode": "IMMEDIATE"}}}
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.TokenAuthentication"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_THROTTLE_RATES": {"afkmemory": "1200/minute"},
}
SPECTACULAR_SETTINGS = {"ENUM_NAME_OVERRIDES": {"EventTypeEnum": "afkmemory.api.schema.EVENT_TYPE_ENUM"}}
"""

URLS = """
from django.contrib import admin
from django.urls import include, path

urlpatterns = [path("admin/", admin.site.urls), path("api/v1/", include("afkmemory.api.urls"))]
"""

#: afkmemory's tables (and the accounts they belong to) on "memory"; the project's own apps on "default".
ROUTER = """
MEMORY_APPS = {"auth", "contenttypes", "admin", "sessions", "authtoken", "afkmemory"}


class MemoryRouter:
    def db_for_read(self, model, **hints):
        return "memory" if model._meta.app_label in MEMORY_APPS else None

    db_for_write = db_for_read

    def allow_relation(self, a, b, **hints):
        return None

    def allow_migrate(self, db, app_label, **hints):
        if app_label in MEMORY_APPS:
            return db == "memory"
        return db == "default"
"""

MULTI_DB = """
DATABASES = {
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "project.sqlite3",
                "OPTIONS": {"transaction_mode": "IMMEDIATE"}},
    "memory": {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "memory.sqlite3",
               "OPTIONS": {"transaction_mode": "IMMEDIATE"}},
}
DATABASE_ROUTERS = ["review_router.MemoryRouter"]
AFKMEMORY = {**AFKMEMORY, "DATABASE_ALIAS": "memory"}
"""

#: Prints one JSON line: what the REST API answered, for one account with a token.
PRELUDE = """
import json, django
django.setup()
from django.core.management import call_command
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.authtoken.models import Token

def client():
    user = get_user_model().objects.create_user("agent")
    token = Token.objects.create(user=user).key
    return Client(raise_request_exception=False, HTTP_AUTHORIZATION=f"Token {token}", HTTP_ACCEPT="application/json")

def answer(response):
    try:
        body = response.json()
    except ValueError:
        body = response.content[:300].decode(errors="replace")
    return [response.status_code, response.headers.get("Content-Type"), body]
"""


def project(tmp_path: Path, extra_settings: str = "", router: bool = False) -> dict[str, str]:
    """Write the project's modules under ``tmp_path``; return the environment to run it with."""
    (tmp_path / "review_settings.py").write_text(BASE_SETTINGS + textwrap.dedent(extra_settings))
    (tmp_path / "review_urls.py").write_text(URLS)
    if router:
        (tmp_path / "review_router.py").write_text(ROUTER)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("DJANGO_", "AFKMEMORY_TEST"))}
    env.update(DJANGO_SETTINGS_MODULE="review_settings", PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    return env


def run(tmp_path: Path, env: dict[str, str], *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def script(tmp_path: Path, env: dict[str, str], body: str) -> dict:
    done = run(tmp_path, env, "-c", PRELUDE + textwrap.dedent(body))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- USE_TZ = False ------------------------------------------------------------------------------


@pytest.mark.slow
def test_store_reads_work_on_sqlite_with_use_tz_false(tmp_path):
    """USE_TZ = False (and a TIME_ZONE other than UTC) on SQLite: the store's reads work.

    They raised ``ValueError: SQLite backend does not support timezone-aware datetimes when
    USE_TZ is False`` (a 500 or 400 through the API): the datetime stand-ins that compile a
    prepared query were aware whatever USE_TZ said.
    """
    env = project(tmp_path, 'USE_TZ = False\nTIME_ZONE = "America/New_York"\n')
    answers = script(
        tmp_path,
        env,
        """
        call_command("migrate", verbosity=0)
        from afkmemory.stores import SyncDjangoStore
        store = SyncDjangoStore()
        store.put(("docs",), "a", {"v": 1}, ttl=3600)
        out = {}
        for name, call in [("get", lambda: store.get(("docs",), "a")), ("search", lambda: store.search(("docs",))),
                           ("namespaces", lambda: store.list_namespaces())]:
            try:
                out[name] = repr(call())
            except Exception as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
        c = client()
        item = {"namespace": ["n"], "key": "k", "value": 1}
        put = c.put("/api/v1/store/items/", item, content_type="application/json")
        out["api put"] = answer(put)[0]
        out["api get"] = answer(c.get("/api/v1/store/items/?namespace=n&key=k"))[0]
        out["api search"] = answer(c.post("/api/v1/store/items/search/", {"namespace_prefix": ["n"]},
                                          content_type="application/json"))
        out["api namespaces"] = answer(c.post("/api/v1/store/namespaces/", {}, content_type="application/json"))
        from datetime import UTC, datetime
        from django.utils import timezone
        store.put(("old",), "k", 1, ttl=0)
        out["sweep at timezone.now()"] = store.sweep_expired(now=timezone.now())
        try:
            store.sweep_expired(now=datetime.now(UTC))
        except TypeError as exc:
            out["sweep at an aware now"] = str(exc)
        print(json.dumps(out))
        """,
    )
    # sweep_expired's now is what timezone.now() gives: naive here, as the error says.
    assert answers["sweep at timezone.now()"] == 1, answers
    assert "naive" in answers["sweep at an aware now"], answers
    assert answers["api put"] == 201
    assert "Error" not in answers["get"], answers["get"]
    assert "Error" not in answers["search"], answers["search"]
    assert "Error" not in answers["namespaces"], answers["namespaces"]
    assert answers["api get"] == 200, answers
    assert answers["api search"][0] == 200, answers["api search"]
    assert answers["api namespaces"][0] == 200, answers["api namespaces"]


# -- multiple databases ---------------------------------------------------------------------------


@pytest.mark.slow
def test_migrate_on_a_database_the_router_keeps_afkmemory_out_of(tmp_path):
    """afkmemory routed to "memory" (DATABASE_ALIAS too, accounts with it); "default" is the project's.

    ``migrate`` of the project's own database (also what ``manage.py test`` runs) stopped at
    ``afkmemory.0001_initial`` with "no such table": ``indexes.CreateSearchIndexes`` ran its
    SQL without asking the router, as Django's own operations and RunPython do.
    """
    env = project(tmp_path, MULTI_DB, router=True)
    memory = run(tmp_path, env, "-m", "django", "migrate", "--database", "memory", "-v", "0")
    assert memory.returncode == 0, memory.stderr[-2000:]
    default = run(tmp_path, env, "-m", "django", "migrate", "-v", "0")
    assert default.returncode == 0, default.stderr[-1500:]


@pytest.mark.slow
def test_migrate_on_a_postgresql_database_the_router_keeps_afkmemory_out_of(tmp_path):
    """The same with the project's own database on PostgreSQL, where afkmemory's operations
    on the memory table (its search indexes, 0008's stored vectors, 0009's index) have SQL of
    their own: each asks the router, and changes nothing there."""
    import psycopg

    from project.settings import database_from_url
    from tests.pg import postgres_url

    name = f"project_{uuid.uuid4().hex[:12]}"
    url = postgres_url()
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        default = {**database_from_url(url), "NAME": name}
        env = project(tmp_path, MULTI_DB + f'DATABASES["default"] = {default!r}\n', router=True)
        memory = run(tmp_path, env, "-m", "django", "migrate", "--database", "memory", "-v", "0")
        assert memory.returncode == 0, memory.stderr[-2000:]
        done = run(tmp_path, env, "-m", "django", "migrate", "-v", "0")
        assert done.returncode == 0, done.stderr[-1500:]
        with psycopg.connect(url, dbname=name) as project_db:
            tables = project_db.execute("SELECT tablename FROM pg_tables WHERE tablename LIKE 'afkmemory%%'")
            assert tables.fetchall() == []
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.slow
def test_checks_speak_when_database_alias_is_a_database_the_router_keeps_afkmemory_out_of(tmp_path):
    """The router puts afkmemory on "memory" but AFKMEMORY["DATABASE_ALIAS"] is left at "default".

    The REST API, the jobs and the commands then failed with "no such table"; ``check`` said
    nothing (E009 checks only that the alias exists). E011 says it, and the jobs say so too.
    """
    env = project(tmp_path, MULTI_DB.replace('AFKMEMORY = {**AFKMEMORY, "DATABASE_ALIAS": "memory"}', ""), router=True)
    answers = script(
        tmp_path,
        env,
        """
        call_command("migrate", database="memory", verbosity=0)
        from django.core import checks
        ids = [problem.id for problem in checks.run_checks() if problem.id.startswith("afkmemory.")]
        from afkmemory import maintenance
        try:
            maintenance.sweep_store()
            sweep = "ok"
        except Exception as exc:
            sweep = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"checks": ids, "sweep": sweep}))
        """,
    )
    assert answers["sweep"].startswith("ImproperlyConfigured: database 'default' does not hold afkmemory's tables")
    assert answers["checks"] == ["afkmemory.E011"], answers["checks"]


@pytest.mark.slow
def test_w005_is_not_raised_for_a_sqlite_database_afkmemory_is_routed_away_from(tmp_path):
    """afkmemory on "memory" (SQLite, IMMEDIATE as README says); the project's own SQLite "default" left DEFERRED.

    W005 told the project to change every transaction of its own database, where afkmemory
    never writes: it now asks the router, as the pgvector check does.
    """
    env = project(tmp_path, MULTI_DB + 'DATABASES["default"]["OPTIONS"] = {}\n', router=True)
    done = run(tmp_path, env, "-m", "django", "check")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "afkmemory.W005" not in done.stdout + done.stderr, done.stdout + done.stderr


# -- ATOMIC_REQUESTS ------------------------------------------------------------------------------

BUSY = """
import sqlite3, subprocess, sys
from django.conf import settings
from django.db import connections
call_command("migrate", verbosity=0)
c = client()
c.put("/api/v1/threads/t/state/k", {"value": 0}, content_type="application/json")
connections.close_all()
path = str(settings.DATABASES["default"]["NAME"])
# It holds the write lock until both requests have answered (its stdin closes), not for a fixed time.
holder = subprocess.Popen(
    [sys.executable, "-c", "import sqlite3, sys; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
     "c.execute('BEGIN IMMEDIATE'); print('held', flush=True); sys.stdin.read()", path],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
holder.stdout.readline()  # another process (a worker, an agent) is writing
read = c.get("/api/v1/threads/t/state/k")
write = c.put("/api/v1/threads/t/state/k", {"value": 1}, content_type="application/json")
holder.stdin.close()
holder.wait()
print(json.dumps({"read": answer(read)[:2], "write": answer(write)[:2] + [write.headers.get("Retry-After")]}))
"""


@pytest.mark.slow
def test_sqlite_busy_under_atomic_requests_answers_as_documented(tmp_path):
    """ATOMIC_REQUESTS = True on README's SQLite settings (IMMEDIATE), another process holding the write lock.

    A read answers 200 and a write 503 with Retry-After, as without ATOMIC_REQUESTS. Both were
    Django's HTML 500: the request's transaction, BEGIN IMMEDIATE, took the write lock for
    every request before the API's error handler ran. The API's views are exempt from it.
    """
    settings = 'DATABASES["default"]["ATOMIC_REQUESTS"] = True\nDATABASES["default"]["OPTIONS"]["timeout"] = 1\n'
    answers = script(tmp_path, project(tmp_path, settings), BUSY)
    assert answers["read"] == [200, "application/json"], answers
    assert answers["write"] == [503, "application/json", "1"], answers


# -- check --deploy ------------------------------------------------------------------------------


@pytest.mark.slow
def test_check_deploy_has_no_warning_from_afkmemorys_schema(tmp_path):
    """``manage.py check --deploy`` in a project installed as README says: no warning.

    drf-spectacular's check generates the project's own schema, which does not read
    afkmemory's schema settings: without README's ``ENUM_NAME_OVERRIDES`` entry it warns of
    two names (``TypeEnum``, ``KeepEventTypesEnum``) for the event types.
    """
    secure = """
    SECURE_HSTS_SECONDS = 3600
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_SSL_REDIRECT = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    """
    done = run(tmp_path, project(tmp_path, secure), "-m", "django", "check", "--deploy")
    output = done.stdout + done.stderr
    assert "drf_spectacular.W001" not in output, output


# -- a model of the project's referring to afkmemory's -------------------------------------------

NOTES_MODELS = """
from django.db import models


class MemoryNote(models.Model):
    memory = models.ForeignKey("afkmemory.LongTermMemory", related_name="+", on_delete=models.PROTECT)


class ThreadNote(models.Model):
    thread = models.ForeignKey("afkmemory.Thread", related_name="+", on_delete=models.PROTECT)
"""

HIDDEN_RELATIONS = """
call_command("migrate", run_syncdb=True, verbosity=0)
from django.urls import reverse
from afkmemory import models
from afkmemory.memory import LongTermMemory, MemoryEvent
from afkmemory.stores import SyncDjangoMemoryStore
from notes.models import MemoryNote, ThreadNote

store = SyncDjangoMemoryStore()
store.upsert_long_term_memory(LongTermMemory("m1", "u1", text="kept"))
store.append_event(MemoryEvent("e1", "t1", None, "message", 1, {}, []))
MemoryNote.objects.create(memory=models.LongTermMemory.objects.get())
ThreadNote.objects.create(thread=models.Thread.objects.get())
staff = Client(raise_request_exception=False)
staff.force_login(get_user_model().objects.create_superuser("staff"))
pages = {}
for model in ("longtermmemory", "thread"):
    url = reverse(f"admin:afkmemory_{model}_changelist")
    form = {"action": "delete_selected", "_selected_action": ["1"], "select_across": "1", "index": "0"}
    page = staff.post(url, form)
    confirmed = staff.post(url, {**form, "post": "yes"})
    pages[model] = [page.status_code, "protected related objects" in page.content.decode(), confirmed.status_code]
print(json.dumps({**pages, "left": [models.LongTermMemory.objects.count(), models.Thread.objects.count()]}))
"""


@pytest.mark.slow
def test_a_project_model_hiding_its_relation_still_gets_djangos_delete_pages(tmp_path):
    """A project's foreign key to a memory or a thread with ``related_name="+"`` and PROTECT.

    The counted delete pages looked for relations in ``_meta.related_objects``, which leaves
    hidden ones out: the page counted the rows and the confirmation raised ProtectedError (a
    500). Django's page lists what protects them, and nothing is deleted."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "__init__.py").write_text("")
    (tmp_path / "notes" / "models.py").write_text(NOTES_MODELS)
    env = project(tmp_path, 'INSTALLED_APPS = [*INSTALLED_APPS, "notes"]\nROOT_URLCONF = "review_urls"\n')
    answers = script(tmp_path, env, HIDDEN_RELATIONS)
    assert answers["longtermmemory"] == [200, True, 200], answers
    assert answers["thread"] == [200, True, 200], answers
    assert answers["left"] == [1, 1], answers


# -- a custom user model --------------------------------------------------------------------------

ACCOUNTS_MODELS = """
import uuid
from django.contrib.auth.models import AbstractUser
from django.db import models


class User(AbstractUser):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
"""


@pytest.mark.slow
def test_cursor_pages_work_for_accounts_with_a_uuid_primary_key(tmp_path):
    """AUTH_USER_MODEL with a UUID primary key: the REST API's cursor pages sign the account
    with the cursor. They answered 500 (a UUID is not JSON) on every page with a next link."""
    (tmp_path / "accounts").mkdir()
    (tmp_path / "accounts" / "__init__.py").write_text("")
    (tmp_path / "accounts" / "models.py").write_text(ACCOUNTS_MODELS)
    env = project(tmp_path, 'INSTALLED_APPS = ["accounts", *INSTALLED_APPS]\nAUTH_USER_MODEL = "accounts.User"\n')
    done = run(tmp_path, env, "-m", "django", "makemigrations", "accounts", "--verbosity=0")
    assert done.returncode == 0, done.stderr[-3000:]
    answers = script(
        tmp_path,
        env,
        """
        call_command("migrate", verbosity=0)
        c = client()
        for i in range(3):
            c.post("/api/v1/memories/", {"id": f"m{i}", "text": "t"}, content_type="application/json")
            c.post("/api/v1/threads/", {"thread_id": f"t{i}"}, content_type="application/json")
        out = {}
        for path in ("memories", "threads"):
            pages, link = [], f"/api/v1/{path}/?page_size=2"
            while link:
                status, _, body = answer(c.get(link))
                pages.append([status, [row.get("id", row.get("thread_id")) for row in body.get("results", [])]])
                link = body.get("next") if status == 200 else None
            out[path] = pages
        print(json.dumps(out))
        """,
    )
    memories = answers["memories"]
    assert [status for status, _ in memories] == [200, 200], answers  # the second page came by cursor
    assert sorted(ident for _, page in memories for ident in page) == ["m0", "m1", "m2"], answers
    assert answers["threads"] == [[200, ["t0", "t1"]], [200, ["t2"]]], answers
