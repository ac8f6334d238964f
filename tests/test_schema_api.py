"""The OpenAPI schema, checked by schemathesis against the running API: no server errors, conforming responses."""

from __future__ import annotations

import io
from urllib.parse import quote, urlencode

import pytest
import schemathesis
from django.core.management import call_command
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytest_plugins = ["tests.api_fixtures"]  # the alias, alice/bob and api/other fixtures
pytestmark = pytest.mark.django_db(databases=["default", "postgres"])

CHECKS = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture
def token(alias: str, accounts_router: None) -> str:
    out = io.StringIO()
    call_command("afkmemory_issue_token", "fuzzer", "--create-user", "--database", alias, stdout=out)
    return out.getvalue().strip()


@pytest.fixture
def wsgi_app():
    """The project's WSGI application, served in-process inside the test's transaction.

    Like Django's test client, stop closing the database connection at the end of each
    request: the connection holds the test's transaction.
    """
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield get_wsgi_application()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def api_schema(token: str, wsgi_app):
    return schemathesis.openapi.from_wsgi(
        "/api/v1/schema/", wsgi_app, headers={"Authorization": f"Token {token}", "Accept": "application/json"}
    )


#: Examples per operation and mode: about 30 operations x 2 modes stay a few hundred requests.
EXAMPLES = {GenerationMode.POSITIVE: 5, GenerationMode.NEGATIVE: 3}


def test_api_conforms_to_its_schema(api_schema, token):
    """Every operation, fed data that fits its schema: never a 500, and every response's status,
    content type and body are the ones the schema documents."""
    _check_operations(api_schema, token, GenerationMode.POSITIVE)


@pytest.mark.parametrize("alias", ["postgres"], indirect=True)
def test_api_refuses_what_its_schema_refuses(api_schema, token):
    """Every operation, fed data that does not fit its schema: never a 500, and documented refusals.

    The API's validation refuses such data before a database reads it: this runs on PostgreSQL
    alone (its search for operations with nothing it can negate is most of its time).
    """
    _check_operations(api_schema, token, GenerationMode.NEGATIVE)


def _check_operations(api_schema, token, mode):
    headers = {"Authorization": f"Token {token}"}
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 25, [op.label for op in operations]

    unsatisfiable, statuses = [], []
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES[mode],
            deadline=None,
            derandomize=True,  # the same examples every run
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate],
        )
        def check(case):
            response = case.call_and_validate(headers=headers, checks=CHECKS)
            statuses.append(response.status_code)

        try:
            check()
        except Unsatisfiable:
            # schemathesis drew no case breaking this operation's schema that it could send (its
            # inputs are free strings and JSON, or path ids): negative mode has nothing to send.
            assert mode is GenerationMode.NEGATIVE, operation.label
            unsatisfiable.append(operation.label)
    assert len(unsatisfiable) < len(operations) // 2, unsatisfiable
    assert len(statuses) >= len(operations) - len(unsatisfiable)  # every operation was called
    if mode is GenerationMode.POSITIVE:
        assert any(200 <= code < 300 for code in statuses)  # and valid data was taken, not just refused


def test_the_schema_names_its_version_once(api):
    """drf-spectacular wrote a version set both in its settings and by the view as "1 (1)"."""
    from tests.api_helpers import url

    info = api.get(url("schema"), HTTP_ACCEPT="application/json").json()["info"]
    assert info["version"] == "1" and info["title"] == "afkmemory API"


def test_a_body_the_api_needs_is_required_in_the_schema(api):
    """POST events/ with no body is a 400 (an event needs its type); the schema left it optional."""
    from tests.api_helpers import url

    paths = api.get(url("schema"), HTTP_ACCEPT="application/json").json()["paths"]
    assert paths["/api/v1/threads/{thread_id}/events/"]["post"]["requestBody"]["required"] is True
    assert api.post(url("threads", "t", "events"), content_type="application/json").status_code == 400
    assert "required" not in paths["/api/v1/store/items/search/"]["post"]["requestBody"]  # all its fields default


def test_a_list_of_events_states_the_length_the_api_takes(api, settings):
    """POST events/ takes one event or a list of 1 to API_MAX_PAGE_SIZE; the schema's list had no bounds."""
    from tests.api_helpers import url

    settings.AFKMEMORY = {**settings.AFKMEMORY, "API_MAX_PAGE_SIZE": 3}
    schemas = api.get(url("schema"), HTTP_ACCEPT="application/json").json()["components"]["schemas"]
    [listed] = [option for option in schemas["EventOrEventsRequest"]["oneOf"] if option.get("type") == "array"]
    assert (listed["minItems"], listed["maxItems"]) == (1, 3)
    events = url("threads", "t", "events")
    for n, status in ((0, 400), (4, 400), (3, 201)):
        body = [{"type": "message", "id": f"e{i}"} for i in range(n)]
        assert api.post(events, body, format="json").status_code == status, n


def test_every_query_integer_has_the_bound_the_api_enforces(api, settings):
    """A page size over API_MAX_PAGE_SIZE is a 400; the schema gave no maximum, so a client
    generated from it (or schemathesis) sent one the schema allowed."""
    from tests.api_helpers import errors, url

    settings.AFKMEMORY = {**settings.AFKMEMORY, "API_MAX_PAGE_SIZE": 300}
    paths = api.get(url("schema"), HTTP_ACCEPT="application/json").json()["paths"]
    bounds = {
        (path, parameter["name"]): parameter["schema"].get("maximum")
        for path, operations in paths.items()
        for operation in operations.values()
        for parameter in operation.get("parameters", [])
        if parameter["in"] == "query" and parameter["schema"].get("type") == "integer"
    }
    assert bounds[("/api/v1/threads/{thread_id}/events/", "limit")] == 300
    assert bounds[("/api/v1/threads/{thread_id}/state/", "limit")] == 300
    assert bounds[("/api/v1/memories/", "page_size")] == 300
    assert bounds[("/api/v1/threads/{thread_id}/events/", "since_ms")] == 2**53 - 1
    assert None not in bounds.values()
    assert "limit" in errors(api.get(url("threads", "t", "state"), {"limit": 301}))


#: A value the API takes for each path parameter and each query parameter sent beside the one
#: under test: those required, and ``user_id`` (a ``DELETE memories/`` needs it, or ``without_user``).
VALID = {"thread_id": "t", "id": "m", "key": "k", "run_id": "r", "namespace": "ns", "user_id": "u"}


def _request(api, method: str, path: str, parameters: list[dict], name: str, value: str):
    values = {**VALID, name: value}
    ids = {p["name"]: quote(values[p["name"]], safe="") for p in parameters if p["in"] == "path"}
    sent = {p["name"] for p in parameters if p["in"] == "query" and (p.get("required") or p["name"] == "user_id")}
    query = urlencode({key: values[key] for key in sent | ({name} - ids.keys())})
    return getattr(api, method)(f"{path.format(**ids)}?{query}")


def test_every_string_parameter_states_the_limits_the_api_enforces(api):
    """The query strings had no bounds in the schema, and the path ids none on NUL: a client
    generated from it sent an empty scope, a 256-byte user_id or a NUL, each a 400. Each string
    parameter now states them; a value past each is refused, naming the parameter."""
    from tests.api_helpers import errors, url

    paths = api.get(url("schema"), HTTP_ACCEPT="application/json").json()["paths"]
    refused = set()
    for path, operations in paths.items():
        for method in {"get", "delete"} & operations.keys():
            parameters = operations[method].get("parameters", [])
            for parameter in parameters:
                name, schema = parameter["name"], parameter["schema"]
                schema = schema["items"] if schema.get("type") == "array" else schema
                if schema.get("type") != "string" or name == "cursor":  # a cursor: what the API handed out
                    continue
                assert "\\x00" in schema["pattern"], (path, name)
                # (An empty path id is another path: the router's 404.)
                bad = ["a\x00b"] + ([""] if schema.get("minLength") and parameter["in"] == "query" else [])
                if "maxLength" in schema:
                    bad.append("x" * (schema["maxLength"] + 1))
                else:  # no bound stated: none enforced either (a state prefix had a limit the schema left out)
                    response = _request(api, method, path, parameters, name, "x" * 5000)
                    assert name not in errors(response), (method, path, name, response.content)
                for value in bad:
                    response = _request(api, method, path, parameters, name, value)
                    assert response.status_code == 400, (method, path, name, value, response.content)
                    assert name in errors(response), (method, path, name, value, response.content)
                    refused.add((method, path, name))
    assert len(refused) >= 20, refused
