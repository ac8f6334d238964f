"""REST API: authentication on every endpoint, the token command, sessions, the schema and docs pages."""

from __future__ import annotations

import io

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from afkmemory import models
from tests.api_helpers import API, ENDPOINTS, make_user, url

pytest_plugins = ["tests.api_fixtures"]  # the alias, alice/bob and api/other fixtures
pytestmark = pytest.mark.django_db(databases=["default", "postgres"])


def issue(*args: str) -> str:
    out = io.StringIO()
    call_command("afkmemory_issue_token", *args, stdout=out)
    return out.getvalue().strip()


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
def test_every_endpoint_requires_authentication(alias, method, path, body):
    response = getattr(APIClient(), method)(API + path, body, format="json")
    assert response.status_code == 401, (method, path, response.status_code)
    assert response["WWW-Authenticate"] == "Token"
    assert not models.Thread.objects.using(alias).exists()
    assert not models.LongTermMemory.objects.using(alias).exists()
    assert not models.StoreItem.objects.using(alias).exists()


def test_token_command_and_token_authentication(alias, accounts_router):
    key = issue("agent", "--create-user", "--database", alias)
    assert len(key) == 40 and issue("agent", "--database", alias) == key  # shown again, not replaced

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    assert client.post(url("threads"), {"thread_id": "t"}, format="json").status_code == 201
    assert models.Thread.objects.using(alias).get().owner.username == "agent"

    new_key = issue("agent", "--reset", "--database", alias)
    assert new_key != key
    assert client.get(url("threads")).status_code == 401  # the old token stopped working
    client.credentials(HTTP_AUTHORIZATION=f"Token {new_key}")
    assert client.get(url("threads")).json()["count"] == 1
    client.credentials(HTTP_AUTHORIZATION="Token not-a-token")
    assert client.get(url("threads")).status_code == 401

    with pytest.raises(CommandError, match="--create-user"):
        issue("nobody", "--database", alias)


@pytest.mark.parametrize("username", ["", "u" * 151, "bad user/with spaces", "a\x01b"])
def test_the_token_command_creates_only_accounts_the_admin_would(alias, username):
    with pytest.raises(CommandError, match="Cannot create an account"):
        issue(username, "--create-user", "--database", alias)
    assert not get_user_model()._default_manager.db_manager(alias).exists()


def test_session_authentication_serves_the_browsable_api_with_csrf(alias, accounts_router):
    make_user(alias, "carol")
    client = APIClient(enforce_csrf_checks=True)
    assert client.login(username="carol", password="pw")
    page = client.get(url("threads"), HTTP_ACCEPT="text/html")
    assert page.status_code == 200 and b"Thread" in page.content
    assert client.get(url("threads")).json()["count"] == 0
    # A session may not write without the CSRF token (token clients need none).
    assert client.post(url("threads"), {"thread_id": "t"}, format="json").status_code == 403
    assert not models.Thread.objects.using(alias).exists()


def test_schema_and_docs_need_a_login(api, alias, accounts_router):
    assert APIClient().get(url("schema")).status_code == 401
    schema = api.get(url("schema"), HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert "/api/v1/threads/{thread_id}/state/{key}" in paths and "/api/v1/store/items/" in paths
    assert "/api/v1/schema/" not in paths

    make_user(alias, "dave")
    browser = APIClient()
    assert browser.get(url("schema", "docs")).status_code in (401, 403)
    assert browser.login(username="dave", password="pw")
    docs = browser.get(url("schema", "docs"))
    assert docs.status_code == 200 and b"swagger" in docs.content.lower()


@pytest.mark.parametrize(
    ("page", "renders"),
    [("", {"application/json", "text/html"}), ("schema/", {"application/json"}), ("schema/docs/", {"text/html"})],
)
def test_the_root_schema_and_docs_pages_answer_errors_as_the_api_does(api, page, renders):
    """The pages that are not viewsets: OPTIONS a 405 and a bad token a 401, in JSON, never a 500.

    The docs page rendered its errors through its HTML template, whose context read the
    failing token again (a 500), and answered OPTIONS with a 500 too (no template)."""
    refused = api.options(API + page)
    assert refused.status_code == 405 and refused.json()["detail"] == 'Method "OPTIONS" not allowed.'
    assert refused["Allow"] == "GET, HEAD"  # it listed OPTIONS, which it refuses
    stranger = APIClient(HTTP_AUTHORIZATION="Token not-a-token")
    for accept in ("application/json", "text/html", "*/*"):
        response = stranger.get(API + page, HTTP_ACCEPT=accept)
        # DRF asks what the page can render before who is asking.
        expected = 401 if accept in renders | {"*/*"} else 406
        assert response.status_code == expected, (accept, response.content[:200])
        assert response["Content-Type"] == "application/json" and "detail" in response.json()


def test_the_docs_page_loads_swagger_ui_from_this_server(api):
    """drf-spectacular's default loads the newest Swagger UI from a CDN, unpinned and unchecked,
    into the origin and session of the admin (helper-103); the example project serves it."""
    import re

    from django.contrib.staticfiles import finders

    page = api.get(url("schema", "docs"), HTTP_ACCEPT="text/html").content.decode()
    loaded = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert loaded and not [address for address in loaded if address.startswith(("http", "//"))], loaded
    for name in ("swagger-ui-bundle.js", "swagger-ui-standalone-preset.js", "swagger-ui.css"):
        assert f"/static/drf_spectacular_sidecar/swagger-ui-dist/{name}" in page
        assert finders.find(f"drf_spectacular_sidecar/swagger-ui-dist/{name}")  # collectstatic takes it


def test_the_docs_page_refuses_what_it_cannot_render_in_json(api):
    refused = api.get(url("schema", "docs"), HTTP_ACCEPT="application/json")
    assert refused.status_code == 406 and "detail" in refused.json()
    assert api.get(url("schema", "docs"), HTTP_ACCEPT="text/html").status_code == 200


def test_the_api_keeps_its_behaviour_under_drfs_default_settings(api, alias, settings):
    """A project that configures only its authentication: the error format and the throttle
    are the API's own, and the one setting the schema needs is pointed out by a check."""
    from django.core.cache import cache

    from afkmemory import checks

    assert checks.check_api_settings() == []  # the example project's settings
    settings.REST_FRAMEWORK = {
        "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.TokenAuthentication"],
        "DEFAULT_THROTTLE_RATES": {"afkmemory": "2/minute"},
    }
    cache.clear()
    anonymous = APIClient().get(url("threads"))
    assert anonymous.status_code == 401 and anonymous["WWW-Authenticate"] == "Token"
    refused = api.post(url("threads"), {"thread_id": "a/b"}, format="json")
    assert refused.status_code == 400 and "thread_id" in refused.json()  # the API's error format
    assert [api.get(url("threads")).status_code for _ in range(2)] == [200, 429]  # two a minute
    assert [p.id for p in checks.check_api_settings()] == ["afkmemory.W004"]
