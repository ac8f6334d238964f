"""The OpenAPI schema, checked by schemathesis against the running API: no server errors, conforming responses."""

from __future__ import annotations

import io

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
