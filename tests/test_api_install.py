"""The REST API in a project configured only as README's "Installing the app in your project" says.

Each case runs in a process of its own: DRF reads its settings into the view classes when
they are imported, so a fresh project's defaults cannot be had by overriding settings here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: README's settings, word for word in what matters (the rest is the minimum Django needs).
SETTINGS = """
SECRET_KEY = "test"
USE_TZ = True
ALLOWED_HOSTS = ["testserver"]  # the docs page builds absolute URLs: it reads the host
TEMPLATES = [{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True}]  # as startproject's
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}}
ROOT_URLCONF = "fresh_urls"
INSTALLED_APPS = [
    "django.contrib.contenttypes", "django.contrib.auth",
    "rest_framework", "rest_framework.authtoken", "drf_spectacular", "afkmemory",
]
AFKMEMORY = {"EMBEDDING_DIMENSIONS": 8}
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.TokenAuthentication"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_THROTTLE_RATES": {"afkmemory": "2/minute"},
}
"""

URLS = """
from django.urls import include, path

urlpatterns = [path("api/v1/", include("afkmemory.api.urls"))]
"""

SCRIPT = """
import json, django
django.setup()
from django.core.management import call_command
from django.test import Client
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from afkmemory.checks import check_api_settings

call_command("migrate", verbosity=0)
def client(name):
    token = Token.objects.create(user=get_user_model().objects.create_user(name)).key
    return Client(raise_request_exception=False, HTTP_AUTHORIZATION=f"Token {token}", HTTP_ACCEPT="application/json")

agent, reader = client("agent"), client("reader")  # two accounts: two budgets of 2 requests a minute
anonymous = Client(HTTP_ACCEPT="application/json")
denied = anonymous.get("/api/v1/threads/")
answers = {
    "anonymous": [denied.status_code, denied.headers.get("WWW-Authenticate")],
    "anonymous root": anonymous.get("/api/v1/").status_code,
    "create": agent.post("/api/v1/threads/", {"thread_id": "t"}, content_type="application/json").status_code,
    "refused": agent.post("/api/v1/threads/", {"thread_id": "a/b"}, content_type="application/json").json(),
    "throttled": agent.get("/api/v1/threads/").status_code,  # the third of the API's this minute
    "schema": reader.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").status_code,
    "docs": reader.get("/api/v1/schema/docs/", HTTP_ACCEPT="text/html").status_code,
    "schema throttled": reader.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").status_code,
    "checks": [problem.id for problem in check_api_settings()],
}
print(json.dumps(answers))
"""


def in_a_fresh_project(tmp_path: Path, settings: str) -> dict:
    (tmp_path / "fresh_settings.py").write_text(settings)
    (tmp_path / "fresh_urls.py").write_text(URLS)
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "fresh_settings", "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_api_works_as_documented_in_a_project_configured_as_the_readme_says(tmp_path):
    answers = in_a_fresh_project(tmp_path, SETTINGS)
    assert answers["anonymous"] == [401, "Token"]
    assert answers["anonymous root"] == 401  # DRF's default root view let anyone list the endpoints
    assert answers["create"] == 201
    assert list(answers["refused"]) == ["thread_id"]  # the API's error format, naming the field
    assert answers["schema"] == 200
    assert answers["docs"] == 200
    assert answers["throttled"] == 429  # the API's own throttle, at the project's rate
    assert answers["schema throttled"] == 429  # the schema, the costliest request, counts too
    assert answers["checks"] == []


@pytest.mark.slow
def test_a_project_without_drf_spectacular_schema_class_is_warned(tmp_path):
    settings = SETTINGS.replace('    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",\n', "")
    answers = in_a_fresh_project(tmp_path, settings)
    assert answers["checks"] == ["afkmemory.W004"]
    assert answers["schema"] == 500  # what the warning is about


@pytest.mark.slow
def test_a_project_without_drf_spectacular_installed_is_warned(tmp_path):
    """check passed, the API worked, and its docs page was a 500 (TemplateDoesNotExist)."""
    settings = SETTINGS.replace('"drf_spectacular", ', "")
    assert settings != SETTINGS
    answers = in_a_fresh_project(tmp_path, settings)
    assert answers["checks"] == ["afkmemory.W006"]
    assert answers["docs"] == 500  # what the warning is about
    assert (answers["create"], answers["schema"]) == (201, 200)  # the rest works without it
