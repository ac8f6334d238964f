"""Fixtures of the REST API tests (a pytest plugin: ``pytest_plugins = ["tests.api_fixtures"]``).

Each test runs once per database, with two tenants. The API reads its database from
``AFKMEMORY['DATABASE_ALIAS']``; the ``alias`` fixture overrides it (keeping the other
test values of ``AFKMEMORY``), and the accounts are created in that same database, as a
deployment keeps them. Clients are authenticated with ``force_authenticate``; token and
session logins, which look accounts up through the router, are tested with
``accounts_router``.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.core.cache import cache
from rest_framework.test import APIClient

from tests.api_helpers import ALIASES, client_for, make_user


@pytest.fixture(params=ALIASES)
def alias(request: pytest.FixtureRequest, settings: Any) -> str:
    """The database of this run of the test: the API's alias, where its accounts live too."""
    settings.AFKMEMORY = {**settings.AFKMEMORY, "DATABASE_ALIAS": request.param}
    # Unthrottled, except in the throttling test, which sets its own rate.
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"afkmemory": None}}
    cache.clear()
    return request.param


@pytest.fixture
def alice(alias: str) -> Any:
    return make_user(alias, "alice")


@pytest.fixture
def bob(alias: str) -> Any:
    return make_user(alias, "bob")


@pytest.fixture
def api(alice: Any) -> APIClient:
    """Alice's client: the tenant whose data each test builds."""
    return client_for(alice)


@pytest.fixture
def other(bob: Any) -> APIClient:
    """Bob's client: another tenant, who must never see or touch Alice's data."""
    return client_for(bob)


@pytest.fixture
def accounts_router(alias: str, settings: Any) -> None:
    """Route accounts, tokens and sessions to the alias (see ``AccountsRouter``)."""
    settings.DATABASE_ROUTERS = ["tests.api_helpers.AccountsRouter"]
